"""The global state of a swarm that nobody can dial, relayed through a reducer node to a peer that needs it.

A joiner, or a peer left behind, downloads the state from donors (p2pdiloco.swarm.statefetch); a donor must
accept connections. Where every live peer is in client mode, none can, so the state goes through the one public
member there is, the reducer node, which holds none of its own:

1. the peer in need publishes a want on the DHT: the state key it will take (the newest its live peers announce)
   and the node it will fetch from (`want_state`), again at every try;
2. a holder of that state or a newer one pushes its own to that node (`push_state`, over a connection the holder
   opens: it can dial out): of those holding the same state, the first by peer id (`pusher_of`);
3. the node keeps the newest state pushed (`HeldState`: twice the model's parameters, while it is wanted; one
   state at a time, the older dropped as a newer push begins) and
   serves its parts as any donor does; the peer, which at each try asks for the newest key its peers announce,
   fetches them and checks them against the key's digest, as from any donor. (The swarm may move on between a
   want and its push: the holders push what they hold, and the next try asks for that.)

Chosen over a node that keeps the state of every round (it would need the model's memory and every round's
sum, not a part of it, for good) and over relays of libp2p (measured unusable between two NAT'd peers:
docs/multi-machine.md): a home uplink sends the state once per peer in need, and the node holds it only while it
is wanted. A pusher can forge nothing: the digest is a hash of the tensors, announced by the peers that hold them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.swarm.records import DHT_CALL_TIMEOUT, TTL, bounded, signed_values
from p2pdiloco.swarm.signing import Identity
from p2pdiloco.swarm.statefetch import parse_part_request, span
from p2pdiloco.swarm.transfer import MAX_PART

logger = get_logger(__name__)
serializer = MSGPackSerializer
HELD_SECONDS = 120.0  # a node drops a relayed state nobody asked a part of for this long
Key = tuple[int, str]


def wanted_key(run_id: str) -> str:
    return f"{run_id}.wanted"


def want_state(dht, run_id: str, identity: Identity, key: Key, node: str) -> None:
    """Say, for a record's lifetime, that we will fetch state `key` from reducer node `node`."""
    bounded(dht.store(wanted_key(run_id), subkey=identity.subkey, value=dict(version=key[0], digest=key[1], node=node),
                      expiration_time=get_dht_time() + TTL, return_future=True), DHT_CALL_TIMEOUT)


@dataclass(frozen=True)
class Want:
    key: Key
    node: str


def fetch_wants(dht, run_id: str) -> list[Want]:
    """The live wants, the malformed ones skipped."""
    wants = []
    for _, v in signed_values(dht, wanted_key(run_id)):
        if isinstance(v, dict) and isinstance(v.get("version"), int) and isinstance(v.get("digest"), str) \
                and isinstance(v.get("node"), str) and len(v["digest"]) <= 64 and len(v["node"]) <= 128:
            wants.append(Want((v["version"], v["digest"]), v["node"]))
    return wants


def pusher_of(records: Sequence[PeerRecord], key: Key) -> Optional[str]:
    """Which live peer pushes state `key`: the first by peer id of those announcing it (every holder reads the same
    records, so one pushes; were the records to differ for a beat, two would, and the node keeps the first)."""
    holders = sorted(r.peer for r in records if r.key == key)
    return holders[0] if holders else None


async def push_state(stub, metadata: dict, tensors: Sequence[torch.Tensor], credential: bytes = b"") -> str:
    """Stream our state to a reducer node's `rpc_state_push`: its metadata first, then Θ ⊕ momentum in parts of
    at most MAX_PART elements, each a serialized tensor in streaming chunks. The node's answer: "" when it took
    it, else why not."""
    total = sum(t.numel() for t in tensors)

    async def messages() -> AsyncIterator[averaging_pb2.DownloadData]:
        header = dict(metadata=metadata, **({"pass": credential} if credential else {}))
        yield averaging_pb2.DownloadData(metadata=serializer.dumps(header))
        for start in range(0, total, MAX_PART):
            part = span(list(tensors), start, min(MAX_PART, total - start))
            for i, chunk in enumerate(split_for_streaming(serialize_torch_tensor(part))):
                yield averaging_pb2.DownloadData(tensor_part=chunk,
                                                 metadata=serializer.dumps(dict(part=start)) if i == 0 else b"")
            await asyncio.sleep(0)

    try:
        async for answer in await stub.rpc_state_push(messages()):
            reply = serializer.loads(answer.metadata) if answer.metadata else {}
            return str(reply.get("error", "")) if isinstance(reply, dict) else "malformed answer"
    except (BrokenPipeError, ConnectionResetError):  # it answered at once and closed: another holder pushed first
        return "the node closed the stream early (it holds this state already, or left)"
    return "no answer"


class HeldState:
    """A reducer node's one relayed state: taken from a pusher whole, served by parts like a donor's."""

    def __init__(self, n: int, admit: Optional[Callable[[str, object], bool]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.n, self.admit, self.clock = n, admit, clock
        self.metadata: Optional[dict] = None
        self.flat: Optional[torch.Tensor] = None
        self.used = 0.0  # when a part of it was last asked for, or it came
        self._taking = asyncio.Lock()  # one push at a time: a second waits, then finds the key held

    @property
    def key(self) -> Optional[Key]:
        return None if self.metadata is None else (self.metadata["version"], self.metadata["digest"])

    def drop_if_idle(self) -> None:
        if self.metadata is not None and self.clock() - self.used > HELD_SECONDS:
            self.metadata = self.flat = None

    async def receive(self, requests: AsyncIterator[averaging_pb2.DownloadData], sender: str) -> str:
        """Take a pushed state; why not, or "". Anything but exactly 2n finite fp32 elements in order is refused;
        a state no newer than the one held is not taken (the held one stays until idle)."""
        async with self._taking:
            self.drop_if_idle()
            header = await anext(requests, None)
            try:
                value = serializer.loads(header.metadata) if header is not None else None
                metadata = value["metadata"]
                key = (metadata["version"], metadata["digest"])
                assert isinstance(key[0], int) and isinstance(key[1], str)
            except Exception:
                return "malformed push: no state metadata"
            if self.admit is not None and not self.admit(sender, value.get("pass")):
                return "no valid pass: this swarm's state goes only to peers that hold its key"
            if self.key is not None and key[0] <= self.key[0]:
                return "" if key == self.key else f"holds a newer state (v{self.key[0]})"
            # one state at a time: the older goes as a newer one comes (whoever fetches it asks for the newest
            # at its next try), so a node holds 8 bytes a parameter for the relay, not 16 while a push is on
            self.metadata = self.flat = None
            flat = await self._parts(requests)
            if isinstance(flat, str):
                return flat
            self.metadata, self.flat, self.used = metadata, flat, self.clock()
            return ""

    async def _parts(self, requests) -> torch.Tensor | str:
        flat, filled, chunks, start = torch.empty(2 * self.n), 0, [], None

        def land() -> Optional[str]:
            nonlocal filled
            try:
                part = deserialize_torch_tensor(combine_from_streaming(chunks))
            except Exception as e:
                return f"malformed part ({type(e).__name__})"
            if start != filled or part.dtype != torch.float32 or part.dim() != 1 \
                    or not 0 < part.numel() <= min(MAX_PART, 2 * self.n - filled) or not torch.isfinite(part).all():
                return f"part at {start} out of order, of the wrong size or not finite"
            flat[filled: filled + part.numel()] = part
            filled += part.numel()
            return None

        async for message in requests:
            if message.metadata:
                if chunks and (why := land()):
                    return why
                try:
                    start = serializer.loads(message.metadata)["part"]
                except Exception:
                    return "malformed part header"
                chunks = []
            chunks.append(message.tensor_part)
        if chunks and (why := land()):
            return why
        return flat if filled == 2 * self.n else f"incomplete state: {filled} of {2 * self.n} elements"

    async def serve_part(self, request: averaging_pb2.DownloadData) -> AsyncIterator[averaging_pb2.DownloadData]:
        """A part of the held state, as a donor serves one (statefetch.PartServer), or why not (not held yet: the
        fetcher asks again until its holder has pushed it)."""
        self.drop_if_idle()
        try:
            version, digest, start, length = parse_part_request(request.metadata)
        except ValueError as e:
            yield _error(str(e))
            return
        if self.key != (version, digest):
            yield _error(f"this reducer node does not hold state v{version} (yet)")
            return
        if start + length > 2 * self.n:
            yield _error("part request beyond the state")
            return
        self.used = self.clock()
        for i, chunk in enumerate(split_for_streaming(serialize_torch_tensor(span([self.flat], start, length)))):
            yield averaging_pb2.DownloadData(tensor_part=chunk,
                                             metadata=serializer.dumps(self.metadata) if i == 0 else b"")


def _error(message: str) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(metadata=serializer.dumps(dict(error=message)))


PUSH_AGAIN = 30.0  # seconds before a holder pushes the same state to the same node again (the node keeps it)


class StatePusher:
    """A peer in client mode, as a holder: pushes its state to the reducer node a want names, where it is the
    state wanted and we are its pusher (`pusher_of`). A thread of its own with its own event loop (for the DHT's
    libp2p replica), looking every `interval` seconds."""

    def __init__(self, dht, run_id: str, peer: str, records: Callable[[], list[PeerRecord]], own: Callable[[], Key],
                 state: Callable[[], tuple[dict, list]], get_stub: Callable, credential: bytes = b"",
                 interval: float = 1.0):
        self.dht, self.run_id, self.peer, self.records, self.state = dht, run_id, peer, records, state
        self.own = own  # the key of the state our record announces
        self.get_stub, self.credential, self.interval = get_stub, credential, interval
        self.pushed: dict[tuple[Key, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-push", daemon=True)

    def start(self) -> "StatePusher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        p2p = None
        try:
            while not self._stop.wait(self.interval):
                try:
                    p2p = p2p or loop.run_until_complete(self.dht.replicate_p2p())
                    for want in self._ours(fetch_wants(self.dht, self.run_id)):
                        loop.run_until_complete(self._push(p2p, want))
                except Exception as e:  # the DHT or the node went away: the next look tries again
                    logger.info(f"pushing our state to a reducer node failed: {type(e).__name__}: {e}")
        finally:
            if p2p is not None:
                with contextlib.suppress(Exception):
                    loop.run_until_complete(p2p.shutdown())
            loop.close()

    def _ours(self, wants: list[Want]) -> list[Want]:
        """The wants we serve now: for our state or an older one, where we push ours (the first by peer id of its
        holders), to nodes we have not pushed it to lately."""
        now, records, key = time.monotonic(), self.records(), self.own()
        if pusher_of(records, key) != self.peer:
            return []
        nodes = {w.node for w in wants if w.key[0] <= key[0]}
        return [Want(key, node) for node in sorted(nodes)
                if now - self.pushed.get((key, node), -PUSH_AGAIN) >= PUSH_AGAIN]

    async def _push(self, p2p, want: Want) -> None:
        metadata, tensors, *_ = self.state()
        if (metadata.get("version"), metadata.get("digest")) != want.key:
            return  # we moved on since our record said so: the next look pushes the new one
        self.pushed[(want.key, want.node)] = time.monotonic()
        started = time.monotonic()
        error = await push_state(self.get_stub(p2p, PeerID.from_base58(want.node)), metadata, tensors,
                                 self.credential)
        if error:
            logger.info(f"reducer node {want.node[-6:]} did not take our state v{want.key[0]}: {error}")
        else:
            logger.info(f"pushed our state v{want.key[0]} to reducer node {want.node[-6:]} for a peer that needs it, "
                        f"in {time.monotonic() - started:.1f} s")
