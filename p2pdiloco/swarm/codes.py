"""Our own reduce-scatter and all-gather of packed integer codes, over the averager's libp2p streams.

Why not a codec at hivemind's seam: hivemind deserializes every tensor part through a fixed protobuf enum of
codecs (a module-level registry) and sends each reduced part back with the sender's codec, so a lossless packed
codec cannot be added without patching hivemind, and its fp32 way back would cost 8× an int4 way out.

A round, once matchmaking formed the group (N members, in the group's order):
1. the flat codes are split into N contiguous parts; member j reduces part j;
2. every member pushes its packed codes of part j to member j (`rpc_codes_push`, streamed in chunks);
3. member j range-checks every code it receives (|code| ≤ L, the exact packed length) and, once it holds all N
   contributions, sums them exactly and packs the sum at its width (`codec.sum_width`);
4. every member fetches each part's sum from its reducer (`rpc_codes_fetch`) and unpacks it.
A reducer serves a sum only when it is complete, so every member that fetched all parts holds the same bits; a
member that cannot fetch a part raises, and its round rolls back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import torch
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.core import codec

CHUNK = 1 << 20  # bytes per stream message (libp2p messages stay well under the daemon's limit)
MAX_PENDING_GROUPS = 4  # reductions kept at once: a push may arrive before our own matchmaking finished
serializer = MSGPackSerializer


class CodesError(RuntimeError):
    pass


def part_ranges(n: int, members: int, align: int = 1) -> list[tuple[int, int]]:
    """N contiguous parts of n elements cut at multiples of `align` (whole blocks), as equal as that allows."""
    units = -(-n // align)
    base, extra = divmod(units, members)
    bounds, start = [], 0
    for j in range(members):
        end = min(n, start + (base + (1 if j < extra else 0)) * align)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class Reduction:
    """Our part of one group's sum: contributions arrive from every member, the sum is served once complete."""

    created: float = field(default_factory=time.monotonic)
    payloads: dict = field(default_factory=dict)  # sender peer id → packed codes
    spec: Optional[tuple] = None  # (senders, length, wire format) once our own round knows the group
    own: Optional[torch.Tensor] = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    result: Optional[bytes] = None
    error: str = ""

    settling: bool = False  # its sum is being computed (off the event loop)

    def settle_if_complete(self) -> None:
        if self._due():
            self._finish(*self._sum())

    async def settle_soon(self) -> None:
        """`settle_if_complete` with the decoding and summing in a worker thread: while a large part is summed,
        the event loop keeps moving the other streams of the round."""
        if self._due():
            self.settling = True
            self._finish(*await asyncio.to_thread(self._sum))

    def _due(self) -> bool:
        return (not self.ready.is_set() and not self.settling and self.spec is not None and self.own is not None
                and set(self.spec[0]) <= set(self.payloads))

    def _sum(self) -> tuple[Optional[bytes], str]:
        senders, length, fmt = self.spec
        total = self.own.to(torch.int64).clone()
        for sender in senders:
            try:  # the exact packed length, codes within ±L, top-k counts and indices: anything else fails
                total += fmt.decode(self.payloads[sender], length)
            except ValueError as e:
                return None, f"{sender[-6:]} sent a malformed part: {e}"
        return fmt.encode_sum(total), ""

    def _finish(self, result: Optional[bytes], error: str) -> None:
        if error:
            return self.fail(error)
        self.result = result
        self.ready.set()

    def fail(self, why: str) -> None:
        self.error = why
        self.ready.set()


class CodesExchange:
    """Lives in the averager process: the reductions we serve and the client side of a round."""

    def __init__(self, max_payload: int):
        self.max_payload = max_payload  # bytes one contribution may take: anything longer is refused
        self.reductions: dict[bytes, Reduction] = {}

    def reduction(self, group_id: bytes) -> Reduction:
        if group_id not in self.reductions:
            while len(self.reductions) >= MAX_PENDING_GROUPS:  # drop the oldest: its round is long over
                del self.reductions[min(self.reductions, key=lambda g: self.reductions[g].created)]
            self.reductions[group_id] = Reduction()
        return self.reductions[group_id]

    # ---- server side: RPC bodies ----------------------------------------------------------------------------
    async def receive(self, requests: AsyncIterator[averaging_pb2.DownloadData], sender: str) -> str:
        header, chunks, size = None, [], 0
        async for message in requests:
            if header is None:
                header = _header(message.metadata)
            size += len(message.tensor_part.buffer)
            if size > self.max_payload:
                return "part too large"
            chunks.append(message.tensor_part.buffer)
        if header is None:
            return "empty push"
        reduction = self.reduction(header["group"])
        if sender in reduction.payloads:
            return "duplicate part"
        if reduction.spec is not None and sender not in reduction.spec[0]:
            return "not a member of this group"  # else a stranger's part would sit beside the members' ones
        reduction.payloads[sender] = b"".join(chunks)
        await reduction.settle_soon()
        return ""

    async def serve(self, request: averaging_pb2.DownloadData, timeout: float) -> AsyncIterator[bytes]:
        header = _header(request.metadata)
        reduction = self.reduction(header["group"])
        try:
            await asyncio.wait_for(reduction.ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise CodesError("the part's sum was not complete in time") from None
        if reduction.error:
            raise CodesError(reduction.error)
        for start in range(0, len(reduction.result), CHUNK):
            yield reduction.result[start:start + CHUNK]

    # ---- client side: one round ------------------------------------------------------------------------------
    async def run(self, group_id: bytes, peers: list, me: int, codes: torch.Tensor, selected: torch.Tensor, fmt,
                  stub_of, timeout: float) -> torch.Tensor:
        """The exact integer sum of every member's codes (0 where the format did not select), or CodesError."""
        n = codes.numel()
        ranges = part_ranges(n, len(peers), align=codec.BLOCK)
        mine = self.reduction(group_id)
        start, end = ranges[me]
        mine.spec = ([str(p) for i, p in enumerate(peers) if i != me], end - start, fmt)
        mine.own = codes[start:end]
        pushes = [self._push(stub_of(peers[j]), group_id, fmt, codes[a:b], selected[a:b])
                  for j, (a, b) in enumerate(ranges) if j != me]
        fetches = [self._fetch(stub_of(peers[j]), group_id, b - a, fmt) if j != me
                   else self._own_sum(mine, timeout) for j, (a, b) in enumerate(ranges)]
        try:
            results = await asyncio.wait_for(asyncio.gather(mine.settle_soon(), *pushes, *fetches), timeout)
        finally:
            self.reductions.pop(group_id, None)
        return torch.cat([r for r in results[1 + len(pushes):]])

    async def _push(self, stub, group_id: bytes, fmt, codes: torch.Tensor, selected: torch.Tensor) -> None:
        data = await asyncio.to_thread(fmt.encode, codes, selected)  # packing one part overlaps pushing another

        async def messages():
            header = serializer.dumps(dict(group=group_id))
            for i, start in enumerate(range(0, max(len(data), 1), CHUNK)):
                yield averaging_pb2.DownloadData(metadata=header if i == 0 else b"",
                                                 tensor_part=_blob(data[start:start + CHUNK]))

        async for answer in await stub.rpc_codes_push(messages()):
            error = serializer.loads(answer.metadata).get("error") if answer.metadata else None
            if error:
                raise CodesError(f"a reducer refused our part: {error}")

    async def _fetch(self, stub, group_id: bytes, length: int, fmt) -> torch.Tensor:
        request = averaging_pb2.DownloadData(metadata=serializer.dumps(dict(group=group_id)))
        chunks = []
        async for message in await stub.rpc_codes_fetch(request):
            if message.metadata:
                raise CodesError(f"a reducer failed: {serializer.loads(message.metadata)}")
            chunks.append(message.tensor_part.buffer)
        try:  # a reducer that died mid-stream leaves a short sum: it fails here like a malformed one
            return await asyncio.to_thread(fmt.decode_sum, b"".join(chunks), length)
        except ValueError as e:
            raise CodesError(f"a reducer's sum arrived incomplete or malformed: {e}") from None

    async def _own_sum(self, mine: Reduction, timeout: float) -> torch.Tensor:
        await asyncio.wait_for(mine.ready.wait(), timeout)
        if mine.error:
            raise CodesError(mine.error)
        _, length, fmt = mine.spec
        return await asyncio.to_thread(fmt.decode_sum, mine.result, length)


def _header(blob: bytes) -> dict:
    try:
        header = serializer.loads(blob)
        if not isinstance(header, dict) or not isinstance(header.get("group"), bytes) or len(header["group"]) > 64:
            raise ValueError
        return header
    except Exception:
        raise CodesError("malformed request header") from None


def _blob(data: bytes):
    from hivemind.proto import runtime_pb2

    return runtime_pb2.Tensor(buffer=data)
