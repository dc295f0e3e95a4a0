"""State transfer in parts from several donors at once (the scheduling lives in p2pdiloco.swarm.transfer).

Donor side: `serve_part` answers the `rpc_state_part` RPC of our averager with one slice of its global
state Θ ⊕ momentum, only if it still holds the state key the joiner asked for (a donor that moved on, or is
mid-round and changed its state, refuses instead of serving something else). Joiner side: `StateFetcher`
calls that RPC on every donor holding the best key, through a replica of the DHT's libp2p daemon (the same
public seam hivemind's MoE client uses: `DHT.replicate_p2p` + `ServicerBase.get_stub`).

Requests and answers reuse hivemind's `averaging_pb2.DownloadData` (bytes metadata + tensor part): the
request carries {version, digest, start, length} as msgpack. Anything malformed gets an error answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from typing import AsyncIterator, Callable, Optional

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from p2pdiloco.runtime.waiting import LeavingError, result_unless_closed
from p2pdiloco.swarm.transfer import MAX_PART, STREAMS_PER_DONOR, Transfer, TransferError, fetch_parts

logger = get_logger(__name__)
SNAPSHOT_SECONDS = 5.0  # a donor reuses one snapshot of its state for the parts of one transfer
serializer = MSGPackSerializer


def parse_part_request(blob: bytes) -> tuple[int, str, int, int]:
    try:
        request = serializer.loads(blob)
        version, digest = request["version"], request["digest"]
        start, length = request["start"], request["length"]
    except Exception as e:
        raise ValueError(f"malformed part request ({type(e).__name__})") from None
    if not (isinstance(version, int) and isinstance(digest, str) and isinstance(start, int)
            and isinstance(length, int) and start >= 0 and 0 < length <= MAX_PART):
        raise ValueError("part request out of bounds")
    return version, digest, start, length


def request_pass(request: averaging_pb2.DownloadData):
    """The requester's swarm pass in a part request (p2pdiloco.swarm.auth), or None."""
    try:
        value = serializer.loads(request.metadata)
        return value.get("pass") if isinstance(value, dict) else None
    except Exception:  # malformed: answered as such by serve_part
        return None


def _error(message: str) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(metadata=serializer.dumps(dict(error=message)))


class IncompletePart(TransferError):
    """A part's stream ended short or its bytes do not make the tensor announced."""


def retry_incomplete(fetch_part):
    """Ask a live donor once more for a part that arrived incomplete. Seen under load on loopback: a part's last
    stream message went missing while the donor lived on. Without the retry the donor was dropped, and with a
    co-donor dead too the whole transfer fell back to hivemind's single-donor download."""
    async def fetch(donor: str, start: int, length: int):
        try:
            return await fetch_part(donor, start, length)
        except IncompletePart as e:
            logger.info(f"part {start}+{length} from {donor[-6:]} arrived incomplete ({e}); asking again")
            return await fetch_part(donor, start, length)
    return fetch


class PartServer:
    """Donor side, inside the averager process; `get_state` fetches the host's current state."""

    def __init__(self, get_state: Callable, clock: Callable[[], float] = time.monotonic):
        self.get_state, self.clock = get_state, clock
        self._snapshot: Optional[tuple[float, dict, list[torch.Tensor]]] = None
        self._taking = asyncio.Lock()  # a joiner asks for several parts at once: one snapshot serves them all

    async def _state(self, version: int, digest: str) -> tuple[dict, list[torch.Tensor]]:
        async with self._taking:
            return await self._snapshot_of(version, digest)

    async def _snapshot_of(self, version: int, digest: str) -> tuple[dict, list[torch.Tensor]]:
        """The snapshot of the state asked for. It stays alive while parts of it are being served: its window
        slides with each request, so a transfer slower than SNAPSHOT_SECONDS in all (a slow link, a big model,
        a slow co-donor) is not refused halfway because we moved on meanwhile. Idle, it is dropped for a new one."""
        now = self.clock()
        fresh = self._snapshot is not None and now - self._snapshot[0] < SNAPSHOT_SECONDS
        if not fresh or (self._snapshot[1]["version"], self._snapshot[1]["digest"]) != (version, digest):
            blob, tensors, _ = await self.get_state()  # hivemind hands the metadata over serialized
            metadata = serializer.loads(blob) if isinstance(blob, bytes) else blob
            # kept as the host handed them over (in shared memory), not concatenated: a part copies its own span
            self._snapshot = (now, metadata, [t.reshape(-1) for t in tensors])
        self._snapshot = (now, *self._snapshot[1:])
        return self._snapshot[1], self._snapshot[2]

    async def serve_part(self, request: averaging_pb2.DownloadData) -> AsyncIterator[averaging_pb2.DownloadData]:
        try:
            version, digest, start, length = parse_part_request(request.metadata)
        except ValueError as e:
            yield _error(str(e))
            return
        metadata, tensors = await self._state(version, digest)
        if (metadata["version"], metadata["digest"]) != (version, digest):
            yield _error(f"moved on: holds version {metadata['version']}")
            return
        if start + length > sum(t.numel() for t in tensors):
            yield _error("part request beyond the state")
            return
        parts = split_for_streaming(serialize_torch_tensor(span(tensors, start, length)))
        for i, part in enumerate(parts):
            yield averaging_pb2.DownloadData(tensor_part=part, metadata=serializer.dumps(metadata) if i == 0 else b"")


def span(tensors: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements [start, start + length) of flat tensors laid end to end, as one fp32 copy of just those."""
    pieces, offset = [], 0
    for t in tensors:
        a, b = max(start - offset, 0), min(start + length - offset, t.numel())
        if a < b:
            pieces.append(t[a:b])
        offset += t.numel()
    return torch.cat(pieces).float() if pieces else torch.empty(0)


class StateFetcher:
    """Joiner side: one background event loop for the libp2p replica, used from the merger's thread."""

    def __init__(self, dht, get_stub: Callable, part_timeout: float, credential: bytes = b"",
                 streams_per_donor: int = STREAMS_PER_DONOR):
        self.dht, self.get_stub, self.part_timeout = dht, get_stub, part_timeout
        self.streams_per_donor = streams_per_donor
        self.credential = credential  # our swarm pass, where the swarm has a key
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._p2p = None  # the DHT's libp2p replica, made on (and bound to) our loop
        self._pending: Optional[concurrent.futures.Future] = None

    def fetch(self, donors: list[str], key: tuple[int, str], total: int, timeout: float,
              leaving: Callable[[], bool] = lambda: False) -> Transfer:
        """`leaving`: polled while the parts come; once it says so, the fetch is cancelled (a large state takes
        minutes over a home uplink, and a peer asked to leave meanwhile leaves now)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="state-fetch", daemon=True).start()
        future = self._pending = asyncio.run_coroutine_threadsafe(self._fetch(donors, key, total), self._loop)
        try:
            return result_unless_closed(future, timeout, leaving)
        except TimeoutError:
            future.cancel()
            raise TransferError(f"no complete state within {timeout:.0f} s") from None
        except LeavingError:
            future.cancel()
            raise TransferError("left while fetching") from None
        except concurrent.futures.CancelledError:
            raise TransferError("closed while fetching") from None

    async def _fetch(self, donors: list[str], key: tuple[int, str], total: int) -> Transfer:
        p2p = self._p2p = await self.dht.replicate_p2p()

        async def fetch_part(donor: str, start: int, length: int) -> tuple[dict, torch.Tensor]:
            stub = self.get_stub(p2p, PeerID.from_base58(donor))
            request = dict(version=key[0], digest=key[1], start=start, length=length)
            if self.credential:
                request["pass"] = self.credential
            stream = await stub.rpc_state_part(averaging_pb2.DownloadData(metadata=serializer.dumps(request)))
            metadata, parts = None, []
            async for message in stream:
                if message.metadata:
                    metadata = serializer.loads(message.metadata)
                    if not isinstance(metadata, dict) or "error" in metadata:
                        raise TransferError(f"donor refused: {metadata}")
                parts.append(message.tensor_part)
            if metadata is None or not parts:
                raise TransferError("donor sent nothing")
            try:
                return metadata, deserialize_torch_tensor(combine_from_streaming(parts))
            except Exception as e:  # bytes that do not make the tensor announced
                raise IncompletePart(f"{type(e).__name__}: {e}") from None

        return await fetch_parts(donors, key, total, retry_incomplete(fetch_part), self.part_timeout,
                                 streams=self.streams_per_donor)

    def close(self) -> None:
        """Close the replica's connection to the daemon on its own loop first (the daemon stays: it is the
        DHT's), so that no task of it is left pending when the loop stops."""
        if self._loop is None:
            return
        if self._pending is not None:
            self._pending.cancel()  # a fetch still waiting returns now rather than at its timeout
            with contextlib.suppress(Exception):  # and unwinds on its loop before the loop stops
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), self._loop).result(1.0)
        if self._p2p is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._released(), self._loop).result(1.0)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _released(self) -> None:
        await self._p2p.shutdown()
        await asyncio.sleep(0.1)  # the cancelled reader and writer tasks finish
