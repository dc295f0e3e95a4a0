"""Per-peer progress records on the DHT: who is alive, at which global version, ready for which round."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from hivemind import DHT
from hivemind.utils import get_dht_time

from p2pdiloco.core.consensus import SKETCH_DIM

HEARTBEAT = 2.0  # seconds between re-publications
TTL = 3 * HEARTBEAT  # a peer silent for this long is considered gone
DHT_CALL_TIMEOUT = 10.0  # one get or store; the DHT answers in well under a second when alive
WITHDRAW_TIMEOUT = 2.0  # withdrawing our record when we leave: the leave has a bound of its own


@dataclass
class PeerRecord:
    peer: str
    name: str
    version: int  # outer steps applied to this peer's global state
    digest: str  # hash of its global parameters: equal digests at equal versions = consensus
    ready: int = -1  # the version it contributes from while it looks for an island, or -1
    inner_step: int = 0
    tokens_per_s: float = 0.0
    sketch: list = field(default_factory=list)  # p2pdiloco.core.consensus.sketch of its Θ

    @property
    def key(self) -> tuple[int, str]:
        return (self.version, self.digest)


def records_key(run_id: str) -> str:
    return f"{run_id}.peers"


def bounded(future, timeout: float):
    """A DHT call's result within `timeout`: hivemind's blocking calls wait forever once the DHT's daemon is
    gone (a terminal's Ctrl-C reaches p2pd too), and a leaving peer must not."""
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        raise


def parse_record(value) -> Optional[PeerRecord]:
    """A remote peer's record, or None if anything in it is malformed: never trusted, never a crash."""
    try:
        record = PeerRecord(**value)
    except TypeError:
        return None
    fields_ok = (isinstance(record.peer, str) and isinstance(record.version, int) and isinstance(record.digest, str)
                 and len(record.digest) >= 6 and isinstance(record.ready, int))
    sketch_ok = isinstance(record.sketch, list) and len(record.sketch) <= SKETCH_DIM and all(
        isinstance(x, (int, float)) and math.isfinite(x) for x in record.sketch)
    return record if fields_ok and sketch_ok else None


def fetch_records(dht: DHT, run_id: str, timeout: float = DHT_CALL_TIMEOUT) -> list[PeerRecord]:
    found = bounded(dht.get(records_key(run_id), latest=True, return_future=True), timeout)
    if found is None or not isinstance(found.value, dict):
        return []
    parsed = [parse_record(getattr(item, "value", None)) for item in found.value.values()]
    return [r for r in parsed if r is not None]


class Heartbeat:
    """Keeps this peer's record fresh and a recent view of everyone's, from a background thread, so the
    training thread never waits on the DHT: `update` returns at once and the thread publishes right away."""

    def __init__(self, dht: DHT, run_id: str, record: PeerRecord):
        self.dht, self.run_id, self.record = dht, run_id, record
        self._lock = threading.Lock()
        self._stop, self._changed = threading.Event(), threading.Event()
        self._records: list[PeerRecord] = []
        self._thread = threading.Thread(target=self._loop, daemon=True, name="heartbeat")
        self._thread.start()

    def update(self, **fields) -> None:
        with self._lock:
            self.record = dataclasses.replace(self.record, **fields)
        self._changed.set()

    def records(self) -> list[PeerRecord]:
        """Every live peer's record as of the last beat (at most HEARTBEAT seconds old)."""
        return list(self._records)

    def publish(self) -> None:
        with self._lock:
            value = dataclasses.asdict(self.record)
        bounded(self.dht.store(records_key(self.run_id), subkey=value["peer"], value=value,
                               expiration_time=get_dht_time() + TTL, return_future=True), DHT_CALL_TIMEOUT)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._changed.clear()
            try:
                self.publish()
                self._records = fetch_records(self.dht, self.run_id)
            except Exception:  # the DHT may be shutting down; the next beat retries
                pass
            self._changed.wait(HEARTBEAT)

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        # withdraw our record so others stop waiting for us at once
        try:
            bounded(self.dht.store(records_key(self.run_id), subkey=self.record.peer, value=None,
                                   expiration_time=get_dht_time() + TTL, return_future=True), WITHDRAW_TIMEOUT)
        except Exception:  # the DHT is gone (e.g. its daemon took the Ctrl-C too): our record expires by itself
            pass


@dataclass
class BarrierResult:
    expected: list[PeerRecord]  # live peers at our version, ourselves excluded
    ready: list[PeerRecord]
    ahead: list[PeerRecord]  # peers at a newer version: we are behind and must resync
    waited: float


def wait_for_round(dht: DHT, run_id: str, me: str, version: int, deadline: float, poll: float = 0.25,
                   stop: Optional[threading.Event] = None) -> BarrierResult:
    """Synchronous-round barrier: wait until every live peer at our version is ready too, or the deadline."""
    start = time.monotonic()
    while True:
        others = [r for r in fetch_records(dht, run_id) if r.peer != me]
        ahead = [r for r in others if r.version > version]
        expected = [r for r in others if r.version == version]
        ready = [r for r in expected if r.ready == version]
        done = ahead or len(ready) == len(expected) or time.monotonic() >= deadline
        if done or (stop is not None and stop.is_set()):
            return BarrierResult(expected, ready, ahead, time.monotonic() - start)
        time.sleep(poll)


def wait_for_quorum(dht: DHT, run_id: str, me: str, others_needed: int, deadline: float, poll: float = 0.25,
                    stop: Optional[threading.Event] = None) -> tuple[float, list[PeerRecord]]:
    """Decoupled rounds: wait until `others_needed` other live peers are looking for an island too (any
    version: stale contributors are welcome). Returns the time it took and the live others."""
    start = time.monotonic()
    while True:
        others = [r for r in fetch_records(dht, run_id) if r.peer != me]
        ready = [r for r in others if r.ready >= 0]
        if len(ready) >= others_needed or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return time.monotonic() - start, others
        time.sleep(poll)
