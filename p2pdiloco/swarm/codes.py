"""Our own reduce-scatter and all-gather of packed integer codes, over the averager's libp2p streams.

Why not a codec at hivemind's seam: hivemind deserializes every tensor part through a fixed protobuf enum of
codecs (a module-level registry) and sends each reduced part back with the sender's codec, so a lossless packed
codec cannot be added without patching hivemind, and its fp32 way back would cost 8× an int4 way out.

A round, once matchmaking formed the group (N senders, R ≤ N of them reducers, in the group's order):
1. the flat codes are split into R contiguous parts; reducer j reduces part j. The reducers are the senders that
   accept connections: a client-mode member (behind a NAT) sends and fetches, and is never dialled;
2. every sender pushes its packed codes of part j to reducer j (`rpc_codes_push`, streamed in chunks);
3. reducer j checks every code it receives (|code| ≤ L, the exact packed length, and within what its sender
   claimed: p2pdiloco.core.claims) and, once it holds all N contributions, sums them exactly and packs the sum
   at its width (`codec.sum_width`);
4. every sender fetches each part's sum from its reducer (`rpc_codes_fetch`), unpacks it, and checks it against
   the claims of the senders summed into it (p2pdiloco.core.claims.sum_why_not): a reducer cannot serve more
   than its senders could have sent, itself included.
A reducer serves a sum only when it is complete, so every member that fetched all parts holds the same bits; a
member that cannot fetch a part raises, and its round rolls back.

A malformed part (bad length, a code out of range, a corrupt stream), or one that has not come when
PART_WAIT of the round's deadline has passed, is left out of its reducer's sum: the sender contributes nothing
to that part, the others' contributions still merge, and the reducer logs who and why. The reducer serves the
names of those it left out with the sum, so every member rescales that part by the weight that is left (the
sum stays a weighted mean, not a shrunken one). Every member fetches the same sum and names, so they still
agree bit for bit. A reducer that serves no sum fails the round for everyone; members
then blame it (CodesError.culprits), and an island whose majority blames a member leaves it out of the next
rounds (p2pdiloco.protocol.island).
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
from p2pdiloco.core.claims import sum_why_not
from p2pdiloco.protocol.island import lower_median

CHUNK = 1 << 20  # bytes per stream message (libp2p messages stay well under the daemon's limit)
PART_WAIT = 0.6  # of the round's deadline: how long a reducer waits for every part before summing those it has
# --robust-merge: a reducer also leaves out a part that does not point the way the others do
AGREEMENT = 0.25  # of the median cosine between each part and the sum of the others
MAX_PENDING_GROUPS = 8  # reductions kept at once: a push may arrive before our own matchmaking finished, a
# fetch after our own round is over (a slower member still needs our part's sum)
serializer = MSGPackSerializer


class CodesError(RuntimeError):
    """The round failed; `culprits` are the members whose part or sum did not come or was malformed."""

    def __init__(self, message: str, culprits: frozenset = frozenset()):
        super().__init__(message)
        self.culprits = culprits


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
    dropped: dict = field(default_factory=dict)  # sender → why its part was left out of the sum

    released: bool = False  # our round is over: only the sum is kept, for members still fetching it
    settling: bool = False  # its sum is being computed (off the event loop)
    cut_off: bool = False  # the wait for missing parts is over: sum those that came
    robust: bool = False  # leave out disagreeing parts too (robust_filter)
    claims: dict = field(default_factory=dict)  # sender → what its codes may hold (p2pdiloco.core.claims)
    start: int = 0  # our part's first element in the whole vector

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
                and (self.cut_off or set(self.spec[0]) <= set(self.payloads)))

    async def cut_off_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.cut_off = True
        await self.settle_soon()

    def _sum(self) -> tuple[Optional[bytes], str]:
        senders, length, fmt = self.spec
        parts = {}
        for sender in senders:
            if sender not in self.payloads:
                self.dropped[sender] = "its part did not come in time"
                continue
            try:  # the exact packed length, codes within ±L, top-k counts and indices: anything else is left out
                parts[sender] = fmt.decode(self.payloads[sender], length)
            except ValueError as e:
                self.dropped[sender] = f"malformed part: {e}"
                continue
            beyond = self.claims[sender].why_not(parts[sender], self.start) if sender in self.claims else ""
            if beyond:
                self.dropped[sender] = beyond
                del parts[sender]
        if self.robust:
            self.dropped.update(robust_filter(parts, self.own.to(torch.int64)))
        total = self.own.to(torch.int64).clone()
        for sender, codes in parts.items():
            if sender not in self.dropped:
                total += codes
        return fmt.encode_sum(total), ""

    def _finish(self, result: Optional[bytes], error: str) -> None:
        if error:
            return self.fail(error)
        self.result = result
        self.ready.set()

    def fail(self, why: str) -> None:
        self.error = why
        self.ready.set()

    def release(self) -> None:
        """Our round is over. The sum stays served: another member may not have fetched it yet (it started
        later, or its fetch was slow to open), and dropping it here would roll that member back while we commit,
        a split. The contributions are freed; the sum is 1/N of the model at its packed width."""
        self.released = True
        self.payloads.clear()
        self.own = None
        if not self.ready.is_set():
            self.fail("the reducer's round ended before its part's sum was complete")


def robust_filter(parts: dict, own: torch.Tensor) -> dict:
    """Sender → why, for the well-formed parts a robust reducer leaves out (our own part is trusted): those that
    point away from the sum of the others (random noise has a cosine of about 0 with it; honest pseudo-gradients
    share a direction)."""
    out = {}
    kept = {s: c.double() for s, c in parts.items()}
    if len(kept) < 2:  # with one other member there is no majority direction to compare against
        return out
    total = own.double() + sum(kept.values())
    cosines = {s: _cosine(c, total - c) for s, c in kept.items()}
    bound = AGREEMENT * lower_median(list(cosines.values()))
    for sender, cos in cosines.items():
        if cos <= 0 or cos < bound:
            out[sender] = f"its part points away from the others' (cosine {cos:.3f}, bound {bound:.3f})"
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    norms = float(a.norm()) * float(b.norm())
    return float(a @ b) / norms if norms > 0 else 0.0


class CodesExchange:
    """Lives in the averager process: the reductions we serve and the client side of a round."""

    def __init__(self, max_payload: int, robust: bool = False):
        self.max_payload = max_payload  # bytes one contribution may take: anything longer is refused
        self.robust = robust
        self.reductions: dict[bytes, Reduction] = {}

    def reduction(self, group_id: bytes) -> Reduction:
        if group_id not in self.reductions:
            while len(self.reductions) >= MAX_PENDING_GROUPS:
                del self.reductions[min(self.reductions, key=self._eviction_order)]
            self.reductions[group_id] = Reduction(robust=self.robust)
        return self.reductions[group_id]

    def _eviction_order(self, group_id: bytes) -> tuple:
        """Finished rounds go first, then groups we are not (yet) in, oldest first; a round of ours in progress
        last, so pushes under made-up group ids cannot evict it."""
        r = self.reductions[group_id]
        return (not r.released, r.spec is not None, r.created)

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
        if reduction.released:
            return "the round of this group is over"
        if sender in reduction.payloads:
            return "duplicate part"
        if reduction.spec is not None and sender not in reduction.spec[0]:
            return "not a member of this group"  # else a stranger's part would sit beside the members' ones
        reduction.payloads[sender] = b"".join(chunks)
        await reduction.settle_soon()
        return ""

    async def serve(self, request: averaging_pb2.DownloadData, timeout: float) -> AsyncIterator[tuple[bytes, bytes]]:
        """(metadata, chunk) pairs of our part's sum: the first names the senders left out of it."""
        header = _header(request.metadata)
        reduction = self.reduction(header["group"])
        try:
            await asyncio.wait_for(reduction.ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise CodesError("the part's sum was not complete in time") from None
        if reduction.error:
            raise CodesError(reduction.error)
        left_out = serializer.dumps(dict(dropped=sorted(reduction.dropped)))
        for start in range(0, max(len(reduction.result), 1), CHUNK):
            yield (left_out if start == 0 else b""), reduction.result[start:start + CHUNK]

    # ---- client side: one round ------------------------------------------------------------------------------
    async def run(self, group_id: bytes, senders: list, reducers: list, me, codes: torch.Tensor,
                  selected: torch.Tensor, fmt, stub_of, timeout: float,
                  claims: Optional[dict] = None) -> tuple[list, list, dict]:
        """The exact integer sum of every sender's codes (0 where the format did not select), part by part (in
        `part_ranges` order: no model-sized concatenation), or CodesError; per part, the senders its reducer left
        out; and why we left out those we did from our own part. Part j is reduced by `reducers[j]`, a member
        that accepts connections; a client-mode sender (not among them) only pushes and fetches. `claims`: sender →
        what its codes may hold (p2pdiloco.core.claims), checked in the part we reduce."""
        ranges = part_ranges(codes.numel(), len(reducers), align=codec.BLOCK)
        mine_at = reducers.index(me) if me in reducers else None
        mine = None
        if mine_at is not None:
            mine = self.reduction(group_id)
            start, end = ranges[mine_at]
            mine.spec = ([str(p) for p in senders if p != me], end - start, fmt)
            mine.own = codes[start:end]
            mine.claims, mine.start = dict(claims or {}), start
        others = [j for j in range(len(reducers)) if j != mine_at]
        pushes = [self._push(stub_of(reducers[j]), group_id, fmt, codes[a:b], selected[a:b])
                  for j, (a, b) in enumerate(ranges) if j != mine_at]
        members = {str(p) for p in senders}
        fetches = [self._fetch(stub_of(reducers[j]), group_id, b - a, fmt, members) if j != mine_at
                   else self._own_sum(mine, timeout) for j, (a, b) in enumerate(ranges)]
        cut_off = asyncio.ensure_future(mine.cut_off_after(PART_WAIT * timeout)) if mine else None
        each = [asyncio.wait_for(step, 0.95 * timeout) for step in (*pushes, *fetches)]  # a hung one is a culprit
        if mine is not None:  # every push may have come before we knew the group: sum them now
            each.insert(0, mine.settle_soon())
        try:
            results = await asyncio.wait_for(asyncio.gather(*each, return_exceptions=True), timeout)
        except asyncio.TimeoutError:
            raise CodesError("the round's parts did not all come in time") from None
        finally:
            if mine is not None:
                cut_off.cancel()
                mine.release()
        results = results[1:] if mine is not None else results
        pushed, fetched = results[:len(pushes)], results[len(pushes):]
        dropped = dict(mine.dropped) if mine is not None else {}
        # a reducer we could not push to, or whose sum did not come, failed the round; so did our own reduction
        culprits = frozenset(str(reducers[j]) for j, r in zip(others, pushed) if isinstance(r, BaseException)) | \
            frozenset(str(reducers[j]) for j, r in enumerate(fetched) if j != mine_at and isinstance(r, BaseException))
        failures = [r for r in (*pushed, *fetched) if isinstance(r, BaseException)]
        if failures:
            raise CodesError(f"{failures[0]}", culprits | frozenset(dropped))
        sums, left_out = zip(*fetched)
        if claims:  # every member checks every part's sum alike: all roll back and all blame a forging reducer
            for j, ((start, _), total, out) in enumerate(zip(ranges, sums, left_out)):
                summed = [claims[s] for s in map(str, senders) if s not in out and s in claims]
                why = sum_why_not(total, start, summed)
                if why:
                    raise CodesError(f"reducer {str(reducers[j])[-6:]} served {why}", frozenset({str(reducers[j])}))
        return list(sums), list(left_out), dropped

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

    async def _fetch(self, stub, group_id: bytes, length: int, fmt, members: set) -> tuple[torch.Tensor, frozenset]:
        request = averaging_pb2.DownloadData(metadata=serializer.dumps(dict(group=group_id)))
        chunks, left_out = [], None
        async for message in await stub.rpc_codes_fetch(request):
            if message.metadata:
                header = _reply(message.metadata)
                if "error" in header or left_out is not None:
                    raise CodesError(f"a reducer failed: {header.get('error', 'a second header')}")
                left_out = _left_out(header.get("dropped"), members)
            chunks.append(message.tensor_part.buffer)
        try:  # a reducer that died mid-stream leaves a short sum: it fails here like a malformed one
            if left_out is None:
                raise ValueError("no header")
            return await asyncio.to_thread(_decode_sum, fmt, b"".join(chunks), length), left_out
        except ValueError as e:
            raise CodesError(f"a reducer's sum arrived incomplete or malformed: {e}") from None

    async def _own_sum(self, mine: Reduction, timeout: float) -> tuple[torch.Tensor, frozenset]:
        await asyncio.wait_for(mine.ready.wait(), timeout)
        if mine.error:
            raise CodesError(mine.error)
        _, length, fmt = mine.spec
        return await asyncio.to_thread(_decode_sum, fmt, mine.result, length), frozenset(mine.dropped)


def _header(blob: bytes) -> dict:
    try:
        header = serializer.loads(blob)
        if not isinstance(header, dict) or not isinstance(header.get("group"), bytes) or len(header["group"]) > 64:
            raise ValueError
        return header
    except Exception:
        raise CodesError("malformed request header") from None


def _reply(blob: bytes) -> dict:
    try:
        header = serializer.loads(blob)
    except Exception:
        header = None
    if not isinstance(header, dict):
        raise CodesError("a reducer sent a malformed header")
    return header


def _left_out(value, members: set) -> frozenset:
    """The senders a reducer says it left out: members of this group, or the sum is not trusted."""
    if not isinstance(value, list) or not all(isinstance(p, str) and p in members for p in value):
        raise CodesError("a reducer named senders it left out that are not members of the group")
    return frozenset(value)


def _blob(data: bytes):
    from hivemind.proto import runtime_pb2

    return runtime_pb2.Tensor(buffer=data)


def _decode_sum(fmt, data: bytes, length: int) -> torch.Tensor:
    """A part's sum, held as int32 until the round dequantizes it (sums of ≤ 64 codes fit in 31 bits): the
    parts of a whole model wait here at once, at half the memory of int64."""
    return fmt.decode_sum(data, length).to(torch.int32)
