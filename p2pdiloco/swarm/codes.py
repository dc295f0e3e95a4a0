"""Our own reduce-scatter and all-gather of packed integer codes, over the averager's libp2p streams, streamed
piece by piece.

Why not a codec at hivemind's seam: hivemind deserializes every tensor part through a fixed protobuf enum of
codecs (a module-level registry) and sends each reduced part back with the sender's codec, so a lossless packed
codec cannot be added without patching hivemind, and its fp32 way back would cost 8× an int4 way out.

A round, once matchmaking formed the group (N senders, R ≤ N of them reducers, in the group's order):
1. the flat codes are split into R contiguous parts; reducer j reduces part j. The reducers are the senders that
   accept connections: a client-mode member (behind a NAT) sends and fetches, and is never dialled. Each part is
   cut into pieces of PIECE elements (whole blocks), the unit that travels, is checked, summed and served;
2. every sender pushes its part j to reducer j (`rpc_codes_push`), one message per piece, each packed in a worker
   thread as the stream asks for it;
3. reducer j checks every piece it receives (|code| ≤ L, the exact packed length, and within what its sender
   claimed: p2pdiloco.core.claims) and, once it holds all N senders' piece, sums it exactly and packs the sum at
   its width (`codec.sum_width`), while the next pieces are still arriving;
4. every sender fetches part j's sums from reducer j (`rpc_codes_fetch`), each piece as soon as it is summed,
   unpacks it, and checks it against the claims of the senders summed into it (core.claims.sum_why_not): a
   reducer cannot serve more than its senders could have sent, itself included.
So packing, sending, summing and fetching overlap: a round costs about its transfer time plus one piece's work,
not the sum of the phases. The codec and the transport do not care how much of the model a round carries.

A reducer serves a piece's sum only when it is complete, so every member that fetched all pieces holds the same
bits; a member that cannot fetch a piece raises, and its round rolls back.

A malformed piece (bad length, a code out of range, beyond its sender's claims), or one that has not come when
PART_WAIT of the round's deadline has passed, is left out of its reducer's sum of that piece: the sender
contributes nothing there, the others' contributions still merge, and the reducer logs who and why. The reducer
serves the names of those it left out with each piece's sum, so every member rescales that piece by the weight
that is left (the sum stays a weighted mean, not a shrunken one). Every member fetches the same sums and names,
so they still agree bit for bit. A reducer that serves no sum fails the round for everyone; members then blame it
(CodesError.culprits), and an island whose majority blames a member leaves it out of the next rounds
(p2pdiloco.protocol.island). A reducer blames a sender whose codes it left out for what they held; one left out
only for coming late is blamed if it is late again soon (protocol.island.Stragglers).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

import torch
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.core import audit, codec
from p2pdiloco.core.claims import sum_why_not
from p2pdiloco.protocol.island import lower_median
from p2pdiloco.runtime.pace import UploadPace, paced

PIECE = 16 * codec.BLOCK  # elements per stream message: even a 32-bit sum of a piece is 1 MB, a quarter of what
# the p2p daemon's messages may carry, and a piece's work (~5 ms to pack int4) is small beside its transfer
LATE = "its part did not come in time"  # why a sender was left out for when, not for what, it sent
ROUND_OVER = "the round of this group is over"  # a push refused for when, not for what, it sent
PART_WAIT = 0.6  # of the round's deadline: how long a reducer waits for every piece before summing those it has
# --robust-merge: a reducer also leaves out a piece that does not point the way the others do
AGREEMENT = 0.25  # of the median cosine between each piece and the sum of the others
AHEAD = 8  # pieces a sender's push may run ahead of the first piece not yet summed: a reducer then holds at most
# this many of each sender's pieces (1 MB of int4 codes), not a fast sender's whole part while a slow one's comes
MAX_PENDING_GROUPS = 8  # reductions kept at once: a push may arrive before our own matchmaking finished, a
# fetch after our own round is over (a slower member still needs our part's sum)
serializer = MSGPackSerializer
# The codec work of a round (quantizing, packing, summing, decoding its pieces) runs in one worker thread, off the
# averager's event loop: a piece's work then overlaps the transfer of the others, and the round takes at most one
# core beside the training process (measured on 2 shared cores, docs/bandwidth.md: with a thread per stream the
# round was no faster and every peer trained ~15 % slower). The thread starts when first used, in the averager.
_CODEC = ThreadPoolExecutor(max_workers=1, thread_name_prefix="codes")


_cpu_seconds = [0.0]  # of the codec thread, all rounds together (one thread: no lock needed)


def codec_cpu_seconds() -> float:
    """CPU seconds the codec thread has worked so far: a round's share is the difference across it. Near the
    round's own seconds, the round waited on a core, not on the link (a CPU peer without a spare one)."""
    return _cpu_seconds[0]


def _counted(fn, *args):
    start = time.thread_time()
    try:
        return fn(*args)
    finally:
        _cpu_seconds[0] += time.thread_time() - start


async def off_loop(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_CODEC, _counted, fn, *args)


class CodesError(RuntimeError):
    """The round failed; `culprits` are the reducers that refused our part or served a bad or no sum, `late` those
    whose sum did not come in time (a busy CPU does that to honest peers: blamed only when late again, as a late
    sender), `dropped` the senders we left out of our own part, and why (as Exchanged.dropped)."""

    def __init__(self, message: str, culprits: frozenset = frozenset(), dropped: Optional[dict] = None,
                 late: frozenset = frozenset()):
        super().__init__(message)
        self.culprits, self.dropped, self.late = culprits, dropped or {}, late


class LateError(CodesError):
    """A sum, ours or a reducer's, that was not complete in time: a matter of when, not of what was sent."""


def faults_and_late(dropped: dict) -> tuple[frozenset, frozenset]:
    """Those left out of our part for what they sent, and those left out only for coming late."""
    late = frozenset(sender for sender, why in dropped.items() if why == LATE)
    return frozenset(dropped) - late, late


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


def piece_ranges(start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) cut into pieces of PIECE elements (whole blocks, as parts start on block boundaries). An
    empty part is one empty piece: every push and every fetch carries at least one message."""
    return [(a, min(a + PIECE, end)) for a in range(start, end, PIECE)] or [(start, end)]


@dataclass
class Piece:
    """One piece of the part we reduce: each sender's packed codes of it, then their sum."""

    payloads: dict = field(default_factory=dict)  # sender peer id → packed codes
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    result: Optional[bytes] = None
    dropped: dict = field(default_factory=dict)  # sender → why its codes were left out of this piece's sum
    settling: bool = False  # its sum is being computed (off the event loop)
    served: set = field(default_factory=set)  # the other members whose fetch stream was handed its sum
    taken: bool = False  # our own round took its sum

    def held(self) -> int:
        """Bytes of codes and sum this piece holds."""
        return sum(map(len, self.payloads.values())) + len(self.result or b"")


@dataclass
class Reduction:
    """Our part of one group's sum: pieces arrive from every member, each piece's sum is served once complete."""

    created: float = field(default_factory=time.monotonic)
    pieces: dict = field(default_factory=dict)  # index in our part → Piece (pushes may come before we know it)
    pushed: set = field(default_factory=set)  # senders that opened a push: a second one is refused
    spec: Optional[tuple] = None  # (senders, length, wire format) once our own round knows the group
    own: Optional[Codes] = None  # our own codes of our part, made a piece at a time as each is summed
    known: asyncio.Event = field(default_factory=asyncio.Event)  # spec set, or the reduction failed
    error: str = ""
    late: bool = False  # the error is that the sum was not complete in time (LateError)
    released: bool = False  # our round is over: only the sums are kept, for members still fetching them
    cut_off: bool = False  # the wait for missing pieces is over: sum those that came
    robust: bool = False  # leave out disagreeing pieces too (robust_filter)
    claims: dict = field(default_factory=dict)  # sender → what its codes may hold (p2pdiloco.core.claims)
    start: int = 0  # our part's first element in the whole vector
    summing: set = field(default_factory=set)  # background sums in flight (kept referenced until done)
    fetched: set = field(default_factory=set)  # members that were served every piece's sum
    over: asyncio.Event = field(default_factory=asyncio.Event)  # every sender was served every sum, or we failed
    group: bytes = b""  # the group's id: it seeds each piece's fingerprints (p2pdiloco.core.audit)
    account: dict = field(default_factory=dict)  # share (a sender, or audit.OWN) → fingerprint of what we summed
    summed_upto: int = 0  # the pieces before this one are summed (or given up): their contributions are freed
    moved: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) when a waiting push may go on
    evicted: bool = False  # dropped for newer groups: pushes still open to it are refused
    held: int = 0  # bytes of codes and sums the pieces hold now
    peak_held: int = 0  # and at most, so far: what the parts in flight cost a reducer

    def begin(self, senders: list, own: Codes, fmt, claims: Optional[dict] = None, start: int = 0) -> None:
        """Our round knows the group: who sends to us (others than ourselves), our own codes of the part (made
        when each piece is summed: none of the whole part are held, 4 bytes per element of it)."""
        self.spec, self.own = (list(senders), own.numel, fmt), own
        self.claims, self.start = dict(claims or {}), start
        self.account = {audit.OWN: audit.zero(), **{sender: audit.zero() for sender in senders}}
        for index in [i for i in self.pieces if i >= len(self.ranges)]:  # pushed before we knew the part's size
            del self.pieces[index]
        for index in range(len(self.ranges)):
            self.piece(index)
        self.known.set()

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The pieces of our part, relative to its start."""
        return piece_ranges(0, self.spec[1])

    @property
    def ready(self) -> bool:
        return self.known.is_set() and all(p.ready.is_set() for p in self.pieces.values())

    def piece(self, index: int) -> Piece:
        if index not in self.pieces:
            self.pieces[index] = Piece()
            if self.error:
                self.pieces[index].ready.set()
        return self.pieces[index]

    def admit(self, sender: str) -> str:
        """Why a push from `sender` is refused, or ""."""
        if self.released:
            return ROUND_OVER
        if sender in self.pushed:
            return "duplicate part"
        if self.spec is not None and sender not in self.spec[0]:
            return "not a member of this group"  # else a stranger's part would sit beside the members' ones
        self.pushed.add(sender)
        return ""

    async def room_for(self, index: int) -> None:
        """Until a sender's piece `index` is within AHEAD of the first piece not yet summed, or the wait is moot
        (the reduction failed, was released, cut off or evicted). The push is not read meanwhile, so the sender's stream
        waits in its transport: the flow control that bounds what a reducer holds by AHEAD pieces per sender."""
        while index >= self.summed_upto + AHEAD and not (self.error or self.released or self.cut_off or self.evicted):
            await self.moved.wait()

    def evict(self) -> None:
        self.evicted = True
        self._move_on()

    def _move_on(self) -> None:
        """Wake the pushes waiting for room: the summed pieces moved on, or the wait became moot."""
        if self.spec is not None:
            while self.summed_upto in self.pieces and self.pieces[self.summed_upto].ready.is_set():
                self.summed_upto += 1
        self.moved.set()
        self.moved = asyncio.Event()

    def add(self, sender: str, index: int, data: bytes, max_pieces: int) -> str:
        """Keep a sender's piece; why it is refused, or ""."""
        if self.released or self.evicted:
            return ROUND_OVER
        if index >= (len(self.ranges) if self.spec is not None else max_pieces):
            return "more pieces than the part has"
        piece = self.piece(index)
        if not (piece.ready.is_set() or piece.settling):  # else summed without it (cut off): not worth keeping
            with self._counting(piece):
                piece.payloads[sender] = data
        return ""

    @contextlib.contextmanager
    def _counting(self, piece: Piece):
        """Count what a change to `piece` adds to or takes from what we hold."""
        before = piece.held()
        yield
        self.held += piece.held() - before
        self.peak_held = max(self.peak_held, self.held)

    # ---- summing ---------------------------------------------------------------------------------------------
    def _due(self, index: int) -> bool:
        piece = self.pieces.get(index)
        return (piece is not None and not piece.ready.is_set() and not piece.settling and self.spec is not None
                and self.own is not None and (self.cut_off or set(self.spec[0]) <= set(piece.payloads)))

    async def settle(self, index: int) -> None:
        """Sum one piece if it is due, in a worker thread: the event loop keeps moving the round's streams."""
        if not self._due(index):
            return
        self.pieces[index].settling = True
        try:
            result = await off_loop(self._sum, index)
        except Exception as e:  # a bug must fail the round, not leave its fetchers waiting until the deadline
            return self.fail(f"summing a piece failed: {e!r}")
        self._finish(index, result)

    async def settle_soon(self) -> None:
        """`settle` every due piece."""
        await asyncio.gather(*(self.settle(i) for i in list(self.pieces)))

    def settle_in_background(self, index: int) -> None:
        if self._due(index):
            task = asyncio.ensure_future(self.settle(index))
            self.summing.add(task)
            task.add_done_callback(self.summing.discard)

    async def cut_off_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.cut_off = True
        self._move_on()
        await self.settle_soon()

    def _sum(self, index: int) -> bytes:
        shares = self._shares(index)
        return self._served(index, shares, sum(shares.values()))

    def _shares(self, index: int) -> dict:
        """audit.OWN → our own codes of a piece, and each sender's codes of it that may be summed (int64); the
        others are left out, and why is noted in the piece."""
        senders, _, fmt = self.spec
        piece, (a, b) = self.pieces[index], self.ranges[index]
        parts = {}
        for sender in senders:
            if sender not in piece.payloads:
                piece.dropped[sender] = LATE
                continue
            try:  # the exact packed length, codes within ±L, top-k counts and indices: anything else is left out
                parts[sender] = fmt.decode(piece.payloads[sender], b - a)
            except ValueError as e:
                piece.dropped[sender] = f"malformed part: {e}"
                continue
            beyond = self.claims[sender].why_not(parts[sender], self.start + a) if sender in self.claims else ""
            if beyond:
                piece.dropped[sender] = beyond
                del parts[sender]
        own = self.own.of(a, b)[0].to(torch.int64)
        if self.robust:
            piece.dropped.update(robust_filter(parts, own))
        return {audit.OWN: own, **{sender: codes.to(torch.int64) for sender, codes in parts.items()
                                   if sender not in piece.dropped}}

    def _served(self, index: int, shares: dict, total: torch.Tensor) -> bytes:
        """A piece's sum, packed as it is served, with each share's fingerprint added to our account of the part:
        fingerprints seeded by the bytes we serve, so we have committed to the sum before we can know them."""
        result = self.spec[2].encode_sum(total)
        a, b = self.ranges[index]
        draws = audit.Fingerprints(audit.piece_seed(self.group, self.start + a, result, self.pieces[index].dropped),
                                   b - a)
        for key, codes in shares.items():
            self.account[key] = self.account[key] + draws.of(codes)
        return result

    def _finish(self, index: int, result: bytes) -> None:
        piece = self.pieces[index]
        with self._counting(piece):
            piece.result = result
            piece.payloads.clear()  # summed: its contributions are no longer needed
        piece.ready.set()
        self._move_on()

    @property
    def dropped(self) -> dict:
        """Sender → why, for those we left out of any piece of our part: the first thing wrong with what it sent,
        else that it came late (a sender cannot hide a malformed piece behind a late one)."""
        out = {}
        for index in sorted(self.pieces):
            for sender, why in self.pieces[index].dropped.items():
                if out.get(sender, LATE) == LATE:
                    out[sender] = why
        return out

    def fail(self, why: str, late: bool = False) -> None:
        self.error, self.late = why, late
        for piece in self.pieces.values():
            piece.ready.set()
        self.known.set()
        self.over.set()
        self._move_on()

    def raise_error(self) -> None:
        if self.error:
            raise (LateError if self.late else CodesError)(self.error)

    def release(self) -> None:
        """Our round is over. The sums stay served until every sender fetched them: one may not have yet (it
        started later, or its fetch was slow to open), and dropping them here would roll that member back while
        we commit, a split. The contributions are freed now; each piece's sum once every member was handed it and
        our own round took it (`_drop_piece_if_done`), and any left once everyone has every piece (`served`)."""
        self.released = True
        for task in self.summing:
            task.cancel()
        for piece in self.pieces.values():
            with self._counting(piece):
                piece.payloads.clear()
        self.own = None
        self._move_on()
        if not self.ready:
            self.fail("the reducer's round ended before its part's sum was complete", late=True)
        self._drop_sums_if_done()

    def served(self, fetcher: str) -> None:
        """`fetcher` got every piece's sum."""
        self.fetched.add(fetcher)
        if self.spec is not None and self.fetched >= set(self.spec[0]):
            self.over.set()
        self._drop_sums_if_done()

    def piece_served(self, index: int, fetcher: str) -> None:
        self.pieces[index].served.add(fetcher)
        self._drop_piece_if_done(index)

    def piece_taken(self, index: int) -> None:
        self.pieces[index].taken = True
        self._drop_piece_if_done(index)

    def _drop_piece_if_done(self, index: int) -> None:
        """A piece's sum goes once our own round took it and every other member was handed it: a reducer holds
        only the sums still on their way, not its whole part's until the last fetcher has the last piece (1/N of
        the model at the sum's width: 150 MB for a 100M model in an island of 2, at the averager's peak). Nobody
        asks for a piece twice: a fetch that breaks fails its round (`_fetch`)."""
        piece = self.pieces[index]
        if piece.taken and self.spec is not None and piece.served >= set(self.spec[0]):
            with self._counting(piece):
                piece.result = None

    def _drop_sums_if_done(self) -> None:
        """Once our round is over and every other sender was served: nobody needs these sums any more (a member
        asking again gets an error, as for a reduction that failed)."""
        if self.released and self.spec is not None and not self.error and self.fetched >= set(self.spec[0]):
            for piece in self.pieces.values():
                with self._counting(piece):
                    piece.result = None
            self.error = "this part's sums were served to every member and dropped"


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


@dataclass(frozen=True)
class Codes:
    """What we send: our codes of [a, b) and which of them the format selected, made when a stream asks for
    them (`of(a, b)`, in a worker thread), so quantizing overlaps sending and no codes of the whole model are held."""

    numel: int
    of: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


SumCheck = Callable[[torch.Tensor, int, frozenset], str]  # (a piece's sum, its first element, left out) → why not
Land = Callable[[int, int, torch.Tensor, frozenset], None]  # (start, end, a piece's checked sum, left out)


@dataclass
class Exchanged:
    """A round's result, piece by piece in the vector's order: the exact integer sums (int32; none kept when they
    were landed as they came), the senders each piece's reducer left out, and why we left out those we did from our
    own part."""

    ranges: list  # (start, end) of each piece in the whole vector
    sums: list
    left_out: list
    dropped: dict


class CodesExchange:
    """Lives in the averager process: the reductions we serve and the client side of a round."""

    reduction_type = Reduction  # a test's or fault plan's hostile reducer subclasses it (p2pdiloco.faults)

    def __init__(self, max_payload: int, robust: bool = False, max_pieces: int = 1 << 16,
                 pace: Optional[UploadPace] = None):
        self.max_payload = max_payload  # bytes one contribution may take: anything longer is refused
        self.pace = pace  # the peer's upload cap, if it set one: our pushes and the sums we serve draw on it
        self.max_pieces = max_pieces  # pieces one contribution may take (the whole model's), before we know ours
        self.robust = robust
        self.reductions: dict[bytes, Reduction] = {}

    def reduction(self, group_id: bytes) -> Reduction:
        if group_id not in self.reductions:
            while len(self.reductions) >= MAX_PENDING_GROUPS:
                self.reductions.pop(min(self.reductions, key=self._eviction_order)).evict()
            self.reductions[group_id] = self.reduction_type(robust=self.robust, group=group_id)
        return self.reductions[group_id]

    def _eviction_order(self, group_id: bytes) -> tuple:
        """Finished rounds go first, then groups we are not (yet) in, oldest first; a round of ours in progress
        last, so pushes under made-up group ids cannot evict it."""
        r = self.reductions[group_id]
        return (not r.released, r.spec is not None, r.created)

    # ---- server side: RPC bodies ----------------------------------------------------------------------------
    async def receive(self, requests: AsyncIterator[averaging_pb2.DownloadData], sender: str) -> str:
        """A sender's pieces of our part, summed as each completes; why the push was refused, or ""."""
        reduction, index, size = None, 0, 0
        async for message in requests:
            if reduction is None:
                reduction = self.reduction(_header(message.metadata)["group"])
                refused = reduction.admit(sender)
                if refused:
                    return refused
            data = message.tensor_part.buffer
            size += len(data)
            if size > self.max_payload:
                return "part too large"
            refused = reduction.add(sender, index, data, self.max_pieces)
            if refused:
                return refused
            reduction.settle_in_background(index)
            index += 1
            await reduction.room_for(index)
        return "" if reduction is not None else "empty push"

    async def serve(self, request: averaging_pb2.DownloadData, timeout: float,
                    fetcher: str = "") -> AsyncIterator[tuple[bytes, bytes]]:
        """(metadata, sum) per piece of our part, each as soon as it is complete; the metadata names the senders
        left out of that piece. Then our account of the part, with no sum. Once `fetcher` has them all, they may
        be dropped (`Reduction.served`)."""
        reduction = self.reduction(_header(request.metadata)["group"])
        deadline = time.monotonic() + timeout
        await _until(reduction.known.wait(), deadline)
        reduction.raise_error()
        for index in range(len(reduction.ranges)):
            piece = reduction.piece(index)
            await _until(piece.ready.wait(), deadline)
            reduction.raise_error()
            if piece.result is None:  # every member had it: this is a second fetch
                raise CodesError("this piece's sum was served to every member and dropped")
            yield serializer.dumps(dict(dropped=sorted(piece.dropped))), piece.result
            reduction.piece_served(index, fetcher)
        # then our account of the part (p2pdiloco.core.audit): the fetcher checks our sums against it
        yield serializer.dumps(dict(account={k: audit.to_bytes(fp) for k, fp in reduction.account.items()})), b""
        reduction.served(fetcher)

    async def push_answer(self, requests: AsyncIterator[averaging_pb2.DownloadData],
                          sender: str) -> averaging_pb2.DownloadData:
        """rpc_codes_push's one reply: empty, or why the part was refused (`late`: our round had ended)."""
        try:
            error = await self.receive(requests, sender)
        except CodesError as e:
            error = str(e)
        return averaging_pb2.DownloadData(
            metadata=serializer.dumps(dict(error=error, late=error == ROUND_OVER)) if error else b"")

    async def fetch_answers(self, requests: AsyncIterator[averaging_pb2.DownloadData], timeout: float,
                            fetcher: str) -> AsyncIterator[averaging_pb2.DownloadData]:
        """rpc_codes_fetch's replies: `serve`'s pieces, or why not, saying whether it is that the sum was not
        complete in time (the fetcher then blames us only if we are late again, as a late sender).

        Then the stream stays open until the fetcher ends its requests, which it does once the last piece came
        (`_fetch`), or `timeout`. Returning at once lost the last piece now and then (3 of 44 member-rounds on the
        testbed, "10 of 11 pieces", never an error): our libp2p daemon resets a stream whose handler has closed
        while it still reads the other way, and a reset drops what the fetcher's daemon has not yet read."""
        request = await anext(requests, None)
        if request is None:
            return
        try:
            async for metadata, chunk in self.serve(request, timeout, fetcher):
                await paced(self.pace, len(chunk))
                yield averaging_pb2.DownloadData(metadata=metadata, tensor_part=runtime_pb2.Tensor(buffer=chunk))
        except CodesError as e:
            yield averaging_pb2.DownloadData(metadata=serializer.dumps(dict(error=str(e),
                                                                            late=isinstance(e, LateError))))
        await _ended(requests, timeout)

    # ---- client side: one round ------------------------------------------------------------------------------
    async def run(self, group_id: bytes, senders: list, reducers: list, me, codes: Codes, fmt, stub_of,
                  timeout: float,
                  claims: Optional[dict] = None, land: Optional[Land] = None) -> Exchanged:
        """The exact integer sum of every sender's codes (0 where the format did not select), piece by piece (no
        model-sized concatenation), or CodesError. Part j is reduced by `reducers[j]`, a member that accepts
        connections; a client-mode sender (not among them) only pushes and fetches. `claims`: sender → what its
        codes may hold (p2pdiloco.core.claims), checked in the part we reduce and in every sum we fetch. `land`,
        if given, takes each piece's checked sum in a worker thread as it comes (decoding overlaps the transfer,
        and no sum of the whole model is held); a round that then fails has landed some pieces and not others."""
        check = _sum_check(claims, senders)
        parts = [piece_ranges(a, b) for a, b in part_ranges(codes.numel, len(reducers), align=codec.BLOCK)]
        mine_at = reducers.index(me) if me in reducers else None
        mine = self.reduction(group_id) if mine_at is not None else None
        pushes = [self._push(stub_of(reducers[j]), group_id, fmt, codes, pieces)
                  for j, pieces in enumerate(parts) if j != mine_at]
        members = {str(p) for p in senders}
        audits = {j: audit.PartAudit(group_id, str(me), lambda a, b: codes.of(a, b)[0], audit.share_bounds(
            claims, members, str(reducers[j]), pieces[0][0], pieces[-1][1])) for j, pieces in enumerate(parts)
            if j != mine_at}  # our own part's sums we made ourselves
        fetches = [self._fetch(stub_of(reducers[j]), group_id, pieces, members, _taker(fmt, check, land, audits[j]),
                               audits[j]) if j != mine_at
                   else self._own_sums(mine, pieces, timeout, _taker(fmt, check, land))
                   for j, pieces in enumerate(parts)]
        cut_off = asyncio.ensure_future(mine.cut_off_after(PART_WAIT * timeout)) if mine else None
        each = [asyncio.wait_for(step, 0.95 * timeout) for step in (*pushes, *fetches)]  # a hung one is a culprit
        if mine is not None:  # our own codes of our part; every piece may have come before we knew the group
            start, end = parts[mine_at][0][0], parts[mine_at][-1][1]
            each.insert(0, self._begin(mine, [str(p) for p in senders if p != me], codes, start, end, fmt, claims))
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
        dropped = mine.dropped if mine is not None else {}
        # a reducer we could not push to, or whose sums did not come or were refused, failed the round; so did our
        # own reduction
        others = [j for j in range(len(reducers)) if j != mine_at]
        failed = {str(reducers[j]): [r for r in (p, fetched[j]) if isinstance(r, BaseException)]
                  for j, p in zip(others, pushed)}
        failed = {reducer: errors for reducer, errors in failed.items() if errors}
        if failed or (mine is not None and isinstance(fetched[mine_at], BaseException)):
            late = frozenset(r for r, errors in failed.items() if all(map(_is_late, errors)))
            why = [f"reducer {r[-6:]}: {_described(e)}" for r, errors in failed.items() for e in errors[:1]]
            if mine is not None and isinstance(fetched[mine_at], BaseException):
                why.insert(0, f"our own part: {_described(fetched[mine_at])}")
            raise CodesError("; ".join(why), frozenset(failed) - late, dropped, late)
        return Exchanged([p for pieces in parts for p in pieces],
                         [s for sums, _ in fetched for s in sums if s is not None],
                         [o for _, out in fetched for o in out], dropped)

    async def reduce_only(self, group_id: bytes, senders: list, reducers: list, me, n: int, fmt, timeout: float,
                          claims: Optional[dict] = None) -> dict:
        """A reducer node's round: it sends nothing and takes no sum, and reduces part j of the `n` elements
        (j: its place among `reducers`) for `senders`, as any reducer does, until every sender was served every
        piece's sum or `timeout`. The senders it left out of its part, and why (Reduction.dropped); CodesError
        if its part's sum was not complete in time."""
        parts = part_ranges(n, len(reducers), align=codec.BLOCK)
        start, end = parts[reducers.index(me)]
        mine = self.reduction(group_id)
        mine.begin([str(p) for p in senders], Codes(end - start, _no_codes), fmt, claims, start)
        for index in range(len(mine.ranges)):  # nobody here takes a sum: each goes once every sender has it
            mine.piece_taken(index)
        cut_off = asyncio.ensure_future(mine.cut_off_after(PART_WAIT * timeout))
        try:
            await mine.settle_soon()  # pieces pushed before we knew the group
            await asyncio.wait_for(mine.over.wait(), timeout)
            mine.raise_error()
        except asyncio.TimeoutError:
            raise LateError(f"not every member fetched our part's sum within {timeout:.0f} s") from None
        finally:
            cut_off.cancel()
            mine.release()
        return mine.dropped

    @staticmethod
    async def _begin(mine: Reduction, senders: list, codes: Codes, start: int, end: int, fmt,
                     claims: Optional[dict]) -> None:
        own = Codes(end - start, lambda a, b: codes.of(start + a, start + b))
        mine.begin(senders, own, fmt, claims, start)
        await mine.settle_soon()

    async def _push(self, stub, group_id: bytes, fmt, codes: Codes, pieces: list) -> None:
        def packed(a: int, b: int) -> bytes:
            return fmt.encode(*codes.of(a, b))

        async def messages():
            header = serializer.dumps(dict(group=group_id))
            for i, (a, b) in enumerate(pieces):  # each made as the stream asks: quantizing, packing overlap sending
                data = await off_loop(packed, a, b)
                await paced(self.pace, len(data))
                yield averaging_pb2.DownloadData(metadata=header if i == 0 else b"", tensor_part=_blob(data))

        async for answer in await stub.rpc_codes_push(messages()):
            header = _reply(answer.metadata) if answer.metadata else {}
            if header.get("error"):
                late = header.get("late") is True
                raise (LateError if late else CodesError)(f"a reducer refused our part: {header['error']}")

    async def _fetch(self, stub, group_id: bytes, pieces: list, members: set, take,
                     account: audit.PartAudit) -> tuple[list, list]:
        """A reducer's sums of its part, each checked (and landed) as it arrives, then its account of them
        (p2pdiloco.core.audit), checked before the round may commit. Our request stream ends once the account is
        in: that tells the reducer it may close (`fetch_answers`)."""
        got_all = asyncio.Event()

        async def requests():
            yield averaging_pb2.DownloadData(metadata=serializer.dumps(dict(group=group_id)))
            await got_all.wait()

        sums, left_out, why = [], [], None
        try:
            async for message in await stub.rpc_codes_fetch(requests()):
                header = _reply(message.metadata)
                if "error" in header:  # it may say it was late: blamed when late again, as any late member
                    late = header.get("late") is True
                    raise (LateError if late else CodesError)(f"a reducer failed: {header['error']}")
                if why is not None:
                    raise CodesError("a reducer sent more pieces than its part has")
                if len(sums) == len(pieces):  # every piece is in: this is its account of them
                    got_all.set()
                    why = await off_loop(account.why_not, header.get("account"))
                    continue
                (start, end), out = pieces[len(sums)], _left_out(header.get("dropped"), members)
                sums.append(await off_loop(take, message.tensor_part.buffer, start, end, out))
                left_out.append(out)
        finally:
            got_all.set()
        if len(sums) < len(pieces):  # a reducer that died mid-stream
            raise CodesError(f"a reducer's sum arrived incomplete: {len(sums)} of {len(pieces)} pieces")
        if why is None:
            raise CodesError("a reducer served its sums without an account of them")
        if why:
            raise CodesError(f"its reducer served {why}")
        return sums, left_out

    async def _own_sums(self, mine: Reduction, pieces: list, timeout: float, take) -> tuple[list, list]:
        deadline = time.monotonic() + timeout
        await _until(mine.known.wait(), deadline)
        sums, left_out = [], []
        for index, (start, end) in enumerate(pieces):
            piece = mine.piece(index)
            await _until(piece.ready.wait(), deadline)
            mine.raise_error()
            out = frozenset(piece.dropped)
            sums.append(await off_loop(take, piece.result, start, end, out))
            left_out.append(out)
            mine.piece_taken(index)
        return sums, left_out


def _no_codes(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A reducer node's own codes of [a, b): it contributes nothing."""
    return torch.zeros(b - a, dtype=torch.int8), torch.zeros(b - a, dtype=torch.bool)


def _sum_check(claims: Optional[dict], senders: list) -> SumCheck:
    """Every member checks every piece's sum alike, against the claims of the senders summed into it: all roll
    back and all blame a forging reducer."""
    def why_not(total: torch.Tensor, start: int, left_out: frozenset) -> str:
        if not claims:
            return ""
        return sum_why_not(total, start, [claims[s] for s in map(str, senders) if s not in left_out and s in claims])
    return why_not


def _taker(fmt, check: SumCheck, land: Optional[Land], account: Optional[audit.PartAudit] = None):
    """A piece's sum as it arrives: decoded, checked, fingerprinted for its reducer's account (not that of our own
    part), then landed (None returned) or kept (returned)."""
    def take(data: bytes, start: int, end: int, left_out: frozenset) -> Optional[torch.Tensor]:
        try:
            total = _decode_sum(fmt, data, end - start)
        except ValueError as e:
            raise CodesError(f"a reducer's sum arrived malformed: {e}") from None
        why = check(total, start, left_out)
        if why:
            raise CodesError(f"its reducer served {why}")
        if account is not None:
            account.add(data, start, end, left_out, total)
        if land is None:
            return total
        land(start, end, total, left_out)
        return None
    return take


def _is_late(error: BaseException) -> bool:
    return isinstance(error, (LateError, asyncio.TimeoutError))


def _described(error: BaseException) -> str:
    return "its sums did not come in time" if isinstance(error, asyncio.TimeoutError) else str(error) or repr(error)


async def _ended(requests: AsyncIterator, timeout: float) -> None:
    """Until a request stream ends, or `timeout`; what else it brings is ignored."""
    async def drain():
        async for _ in requests:
            pass
    try:
        await asyncio.wait_for(drain(), timeout)
    except asyncio.TimeoutError:
        pass


async def _until(waiting, deadline: float) -> None:
    try:
        await asyncio.wait_for(waiting, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise LateError("the part's sum was not complete in time") from None


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
        header = serializer.loads(blob) if blob else None
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
    """A piece's sum, held as int32 until the round dequantizes it (sums of ≤ 64 codes fit in 31 bits): the
    pieces of a whole model wait here at once, at half the memory of int64."""
    return fmt.decode_sum(data, length).to(torch.int32)
