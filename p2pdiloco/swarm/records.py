"""Per-peer progress records on the DHT: who is alive, at which global version, ready for which round."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import Counter
from typing import Callable, Optional

from hivemind import DHT
from hivemind.utils import get_dht_time

from p2pdiloco.protocol.remote import LANE_FIELDS, WIRE_VERSION, PeerRecord, parse_peer_record, record_wire
from p2pdiloco.swarm.signing import Identity, owner_peer, signed_by

log = logging.getLogger("p2pdiloco")

HEARTBEAT = 2.0  # seconds between re-publications
TTL = 3 * HEARTBEAT  # a peer silent for this long is considered gone
DHT_CALL_TIMEOUT = 10.0  # one get or store; the DHT answers in well under a second when alive
WITHDRAW_TIMEOUT = 2.0  # withdrawing our record when we leave: the leave has a bound of its own
REJOIN_EVERY = 5.0  # seconds between pings of our initial peers while we see no other peer
SHARED_FETCH_AGE = 0.2  # a peer's fragments polling within this share one fetch (a round polls every 0.25 s)
# A round's poll, and each beat, read our node's own copy of the records where other peers' stores reach it as they
# are made: hivemind keeps each key on its 5 nearest nodes (every node, in a swarm of 5) and a store reaches them
# at once, so there that copy is current and asks nobody. It is read as any copy whose newest record was stored at
# most POLL_LAG ago (our own beat keeps ours inside it), and trusted where it holds another peer's record stored
# within the last beat and since our last fetch of every copy: it came by a store, not in that fetch. Elsewhere our
# copy is hivemind's cache of our last fetch, and they fetch every copy: a poll at most every COPY_POLL_AGE, a beat
# once a beat. A fetch of every copy was ~30 KB at P = 1 and ~90 KB at P = 8 on 4 peers (docs/fragments.md),
# 120-230 KB on 10 nodes (docs/bandwidth.md).
POLL_LAG = HEARTBEAT
COPY_POLL_AGE = 0.5  # a round polls every 0.25 s: every other poll, where our node holds no replica
# A read of the records waits at most this long where we hold a view read within the last TTL − VIEW_WAIT seconds,
# and that view then serves: a DHT get that stalls (seen once in ~20 testbed runs, for over 10 s) would otherwise
# fail the round it came from, and with it every island that counted on us. Without a recent view (a join) a read
# waits DHT_CALL_TIMEOUT and a stall is an error, as before.
VIEW_WAIT = HEARTBEAT


def records_key(run_id: str) -> str:
    return f"{run_id}.peers"


def reducers_key(run_id: str) -> str:
    return f"{run_id}.reducers"


def announce_reducer(dht: DHT, run_id: str, identity: Identity, name: str) -> None:
    """A reducer node says it is up (it publishes no peer record: trainers would count it as a peer that is never
    ready)."""
    bounded(dht.store(reducers_key(run_id), subkey=identity.subkey, value=dict(peer=identity.peer_id, name=name),
                      expiration_time=get_dht_time() + TTL, return_future=True), DHT_CALL_TIMEOUT)


def signed_values(dht: DHT, key: str, timeout: float = DHT_CALL_TIMEOUT) -> list[tuple[str, object]]:
    """(peer, value) for the values stored under `key` that have not expired, by the peers that signed them
    (p2pdiloco.swarm.signing): anything else under `key` is not anyone's. The caller validates the values."""
    found = bounded(dht.get(key, latest=True, return_future=True), timeout)
    if found is None or not isinstance(found.value, dict):
        return []
    owned = ((owner_peer(subkey), item) for subkey, item in found.value.items())
    return [(peer, getattr(item, "value", None)) for peer, item in owned if peer is not None]


def fetch_reducers(dht: DHT, run_id: str, timeout: float = DHT_CALL_TIMEOUT) -> list[dict]:
    """The live reducer nodes' announcements ({peer, name}), the malformed ones and any in another's name skipped."""
    out = [dict(peer=v["peer"], name=v["name"]) for owner, v in signed_values(dht, reducers_key(run_id), timeout)
           if isinstance(v, dict) and all(isinstance(v.get(k), str) and len(v[k]) <= 128 for k in ("peer", "name"))
           and v["peer"] == owner]
    return sorted(out, key=lambda r: (r["name"], r["peer"]))


def bounded(future, timeout: float):
    """A DHT call's result within `timeout`: hivemind's blocking calls wait forever once the DHT's daemon is
    gone (a terminal's Ctrl-C reaches p2pd too), and a leaving peer must not."""
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        raise


def fetch_records(dht: DHT, run_id: str, timeout: float = DHT_CALL_TIMEOUT,
                  lag: Optional[float] = None) -> list[PeerRecord]:
    return [record for record, _ in fetch_records_seen(dht, run_id, timeout, lag)]


def fetch_records_seen(dht: DHT, run_id: str, timeout: float = DHT_CALL_TIMEOUT,
                       lag: Optional[float] = None) -> list[tuple[PeerRecord, Optional[float]]]:
    """Every live, well-formed peer record, signed by the peer it names, with the seconds since its peer last
    published it (None: unknown). From every replica's copy, merged; or, with `lag`, from any copy (our node's own
    first) whose newest record was stored at most `lag` seconds ago (POLL_LAG)."""
    if lag is None:
        fresh = dict(latest=True)
    else:  # a copy's expiration is its newest record's: stored at expiration − TTL
        fresh = dict(latest=False, sufficient_expiration_time=get_dht_time() + TTL - lag)
    found = bounded(dht.get(records_key(run_id), return_future=True, **fresh), timeout)
    if found is None or not isinstance(found.value, dict):
        return []
    now, seen = get_dht_time(), []
    for subkey, item in found.value.items():
        record = parse_peer_record(getattr(item, "value", None))
        expiration = getattr(item, "expiration_time", None)
        if record is not None and signed_by(subkey, record.peer):
            age = max(0.0, now - (expiration - TTL)) if isinstance(expiration, (int, float)) else None
            seen.append((record, age))
    return seen


def other_wires(dht: DHT, run_id: str, timeout: float = DHT_CALL_TIMEOUT) -> Counter:
    """Wire version → live peers announcing it, for the versions other than ours (their records are not parsed),
    counted only where signed by the peer they name (the `peer` field, which every version keeps): an unsigned
    record is anyone's, and a flood of them claiming another version would stop every peer that joins. Peers before
    version 3 signed nothing, so they are not counted (nor can they read our records: docs/hostile.md)."""
    versions = (record_wire(v) for owner, v in signed_values(dht, records_key(run_id), timeout)
                if isinstance(v, dict) and v.get("peer") == owner)
    return Counter(v for v in versions if v != WIRE_VERSION)


def _left(deadline: float) -> float:
    """Seconds until `deadline`, never negative (a lock's -1 would wait forever)."""
    return max(0.0, deadline - time.monotonic())


class Heartbeat:
    """Keeps this peer's record fresh and a recent view of everyone's, from a background thread (from `start`
    on), so the training thread never waits on the DHT: `update` returns at once and the thread publishes right
    away."""

    def __init__(self, dht: DHT, run_id: str, record: PeerRecord, identity: Identity,
                 rejoin: Optional[Callable[[], object]] = None):
        if record.peer != identity.peer_id:
            raise ValueError(f"a record of {record.peer} cannot be signed by {identity.peer_id}")
        self.dht, self.run_id, self.record, self.identity = dht, run_id, record, identity
        self.rejoin = rejoin  # called while no other peer's record is seen: asks our initial peers again
        self._rejoined = float("-inf")
        self._lock, self._fetching = threading.Lock(), threading.Lock()
        self._stop, self._changed = threading.Event(), threading.Event()
        self._records: list[PeerRecord] = []
        self._fetched_at = self._polled_at = self._fetched_dht = float("-inf")
        self.fetches = 0  # of every replica's copy
        self.stores = 0  # of our record: a beat's, or an announcement's (docs/fragments.md counts them per run)
        self._started = self._stopped = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="heartbeat")

    def start(self) -> "Heartbeat":
        """Publish from now on (a peer starts once its record tells its restored state); once, however often asked
        (each fragment of a peer asks)."""
        with self._lock:
            if self._started:
                return self
            self._started = True
        self._thread.start()
        return self

    def update(self, **fields) -> None:
        """Change our record and publish it now (what rounds decide on: version, readiness)."""
        self.note(**fields)
        self._changed.set()

    def note(self, **fields) -> None:
        """Change our record; it goes out with the next beat (progress for onlookers: no extra DHT store)."""
        with self._lock:
            self.record = dataclasses.replace(self.record, **fields)

    def note_lane(self, i: int, **fields) -> None:
        """Change fragment i's fields of our record (fragment 0's are the record's own; the others' keep only
        LANE_FIELDS: progress such as the loss is the peer's, told by fragment 0)."""
        if i == 0:
            return self.note(**fields)
        with self._lock:
            lanes = list(self.record.lanes)
            lanes[i - 1] = {**lanes[i - 1], **{k: v for k, v in fields.items() if k in LANE_FIELDS}}
            self.record = dataclasses.replace(self.record, lanes=lanes)

    def update_lane(self, i: int, **fields) -> None:
        self.note_lane(i, **fields)
        self._changed.set()

    def records(self) -> list[PeerRecord]:
        """Every live peer's record as of the last fetch (at most HEARTBEAT seconds old)."""
        return list(self._records)

    def fetch(self, max_age: float = 0.0) -> list[PeerRecord]:
        """Every live peer's record from every replica's copy, fetched now, or as any caller fetched it within
        `max_age` seconds (so the fragments of a peer, polling side by side, make one DHT request, not P); `records`
        gives the same view. A stalled DHT: see VIEW_WAIT."""
        return self._within_wait(lambda timeout: self._read(max_age, timeout))

    def poll(self, max_age: float = 0.0) -> list[PeerRecord]:
        """As `fetch`, for a round waiting for peers (four times a second): our node's own copy where other peers'
        stores reach it as they are made, every copy at most every COPY_POLL_AGE otherwise (a node in client mode,
        which holds no replica: every copy, as `fetch`)."""
        if self.record.client_mode:
            return self.fetch(max_age)
        return self._within_wait(lambda timeout: self._view(max_age, COPY_POLL_AGE, timeout))

    def _within_wait(self, read: Callable[[float], list[PeerRecord]]) -> list[PeerRecord]:
        """`read(timeout)`, bounded by VIEW_WAIT where our last view is recent enough to stand in for it."""
        viewed = max(self._fetched_at, self._polled_at)
        if time.monotonic() - viewed > TTL - VIEW_WAIT:
            return read(DHT_CALL_TIMEOUT)
        try:
            return read(VIEW_WAIT)
        except TimeoutError:
            log.warning("the DHT did not answer a read of the records within %.0f s: going on with the view of "
                        "%.1f s ago", VIEW_WAIT, time.monotonic() - viewed)
            return list(self._records)

    @contextlib.contextmanager
    def _reading(self, deadline: float):
        """One read at a time (a stalled one holds the others back, so they wait for it no longer than for the DHT)."""
        if not self._fetching.acquire(timeout=_left(deadline)):
            raise TimeoutError("another read of the records has not ended in time")
        try:
            yield
        finally:
            self._fetching.release()

    def _view(self, max_age: float, every_copy_age: float, timeout: float = DHT_CALL_TIMEOUT) -> list[PeerRecord]:
        """Everyone's records: as read within `max_age`; else from our node's own copy where it holds another peer's
        record stored within a beat and since our last fetch (a replica: every node is one in a swarm of 5, and
        each peer stores every beat), which asks nobody; else from every copy, fetched within `every_copy_age` (our
        copy is then a cache of that fetch). All of it within `timeout`, its steps together."""
        deadline = time.monotonic() + timeout
        with self._reading(deadline):
            if time.monotonic() - max(self._fetched_at, self._polled_at) <= max_age:
                return list(self._records)
            seen = fetch_records_seen(self.dht, self.run_id, timeout=_left(deadline), lag=POLL_LAG)
            # a record stored since our last fetch came to our node by a store, not in that fetch
            newer = min(HEARTBEAT, get_dht_time() - self._fetched_dht)
            if any(r.peer != self.record.peer and age is not None and age < newer for r, age in seen):
                self._records, self._polled_at = [r for r, _ in seen], time.monotonic()
                return list(self._records)
        return self._read(every_copy_age, _left(deadline))

    def _read(self, max_age: float, timeout: float = DHT_CALL_TIMEOUT) -> list[PeerRecord]:
        """Every copy, fetched now or within `max_age`, within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._reading(deadline):
            if time.monotonic() - self._fetched_at > max_age:
                self._records = fetch_records(self.dht, self.run_id, timeout=_left(deadline))
                self._fetched_at, self._fetched_dht = time.monotonic(), get_dht_time()  # after: what came meanwhile is
                # in the fetch, not proof that stores reach our copy
                self.fetches += 1
            return list(self._records)

    def publish(self) -> None:
        with self._lock:
            if self._stop.is_set():  # we are leaving: a store dated after our withdrawal would outlive it
                return
            value, expiration = self.record.value(), get_dht_time() + TTL
            self.stores += 1
        bounded(self.dht.store(records_key(self.run_id), subkey=self.identity.subkey, value=value,
                               expiration_time=expiration, return_future=True), DHT_CALL_TIMEOUT)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._changed.clear()
            try:
                self.publish()
                if not self._changed.is_set():  # an update that came during the store goes out first
                    self._beat_view()
                    self._rejoin_if_alone()
            except Exception:  # the DHT may be shutting down; the next beat retries
                pass
            self._changed.wait(HEARTBEAT)

    def _beat_view(self) -> None:
        """The beat's view of everyone's records, as a poll's but renewed once a beat. It fetched every copy each
        beat before: about half of a peer's heartbeat bytes, on 5 nodes and on 10 (docs/bandwidth.md)."""
        if self.record.client_mode:
            self.fetch(max_age=HEARTBEAT / 2)
        else:
            self._view(HEARTBEAT / 2, every_copy_age=HEARTBEAT / 2)

    def _rejoin_if_alone(self) -> None:
        if self.rejoin is None or any(r.peer != self.record.peer for r in self._records):
            return
        if time.monotonic() - self._rejoined >= REJOIN_EVERY:
            self._rejoined = time.monotonic()
            self.rejoin()

    def stop(self) -> None:
        """Stop, and withdraw our record; once, however often asked."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._stop.set()
            log.info("heartbeat: %d stores of our record, %d fetches of every copy", self.stores, self.fetches)
            # dated after every store a beat may still send (each dates itself under this lock, before we set
            # the stop): of two stores of one subkey the DHT keeps the later expiration, so the withdrawal wins
            # even where a beat's store lands after it
            expiration = get_dht_time() + TTL
        self._changed.set()
        # withdraw our record so others stop waiting for us at once
        try:
            bounded(self.dht.store(records_key(self.run_id), subkey=self.identity.subkey, value=None,
                                   expiration_time=expiration, return_future=True), WITHDRAW_TIMEOUT)
        except Exception:  # the DHT is gone (e.g. its daemon took the Ctrl-C too): our record expires by itself
            pass


class LaneBeat:
    """Fragment i's side of its peer's one heartbeat: a peer of P fragments publishes one record, with the other
    fragments' fields in `PeerRecord.lanes`, and fetches the swarm's records once for all of them. To fragment i's
    merger this is a heartbeat whose records are the fragment's (`PeerRecord.lane`), as if the fragment were a
    swarm of its own. P heartbeats sent P times the control bytes: 2.6 Mbit/s at rest at P = 8 (docs/fragments.md)."""

    def __init__(self, beat: Heartbeat, i: int):
        self.beat, self.i = beat, i

    @property
    def identity(self) -> Identity:
        return self.beat.identity

    @property
    def record(self) -> PeerRecord:
        return self.beat.record.lane(self.i)

    def update(self, **fields) -> None:
        self.beat.update_lane(self.i, **fields)

    def note(self, **fields) -> None:
        self.beat.note_lane(self.i, **fields)

    def records(self) -> list[PeerRecord]:
        return self._lanes(self.beat.records())

    def fetch(self) -> list[PeerRecord]:
        return self._lanes(self.beat.fetch(max_age=SHARED_FETCH_AGE))

    def poll(self) -> list[PeerRecord]:
        return self._lanes(self.beat.poll(max_age=SHARED_FETCH_AGE))

    def others_looking(self) -> bool:
        """Another peer looks for an island for this fragment (its `ready`), as last fetched: no DHT request."""
        me = self.beat.record.peer
        return any(r.peer != me and r.ready >= 0 for r in self.records())

    def start(self) -> "LaneBeat":
        self.beat.start()
        return self

    def stop(self) -> None:
        self.beat.stop()

    def _lanes(self, records: list[PeerRecord]) -> list[PeerRecord]:
        return [lane for lane in (r.lane(self.i) for r in records) if lane is not None]
