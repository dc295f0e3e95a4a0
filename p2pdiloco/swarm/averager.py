"""The one subclass of hivemind's DecentralizedAverager: exact, verified rounds and state sharing.

Hooks (hivemind==1.1.12), all in the averager process:
- `_aggregate_with_group` runs after matchmaking, with the group's gathered metadata in hand and before any
  tensor moves. hivemind's own PowerSGD averager and its fault-tolerance tests override this same seam. We plan
  the island from the gathered records (p2pdiloco.protocol.island), encode the pseudo-gradient as integer codes
  on block scales the group agrees on, and sum them exactly with our own streamed reduce-scatter and all-gather
  over hivemind's libp2p streams (p2pdiloco.swarm.codes; `rpc_codes_*`). Every wire format goes that way, the
  default one too (20-bit codes): hivemind's fp32 all-reduce is not used, and its reducer RPC refuses all parts.
- `rpc_join_group` (hivemind's leader RPC): members rejected, left out or blamed lately are turned away.
tests/unit/test_averager_seams.py drives the RPC hooks without a network. Every seam below hivemind's public API,
these and the others, is listed with its test in p2pdiloco.swarm.seams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.logging import get_logger

from p2pdiloco.core import codec
from p2pdiloco.core.claims import Claims, block_norms, claims_in_codes
from p2pdiloco.protocol.island import Bounds, PenaltyBox, Stragglers, plan_island
from p2pdiloco.protocol.remote import Expect, parse_island
from p2pdiloco.protocol.round import IslandReduced
from p2pdiloco.runtime.heap import give_back_free_heap
from p2pdiloco.runtime.paging import FileVectors
from p2pdiloco.swarm.codes import Codes, CodesExchange, codec_cpu_seconds, faults_and_late, piece_ranges
from p2pdiloco.swarm.auth import MemberPasses
from p2pdiloco.swarm.statefetch import PartServer, request_pass
from p2pdiloco.protocol.timing import allreduce_wire_bytes

logger = get_logger(__name__)

REFUSE_SECONDS = 120.0  # a member rejected from our island, or blamed by us, is turned away this long when it
# asks to join our group (it may still lead a group we join: then the island leaves it out again)
# a leader's join stream stays open this long after its last message (the group to run with): see rpc_join_group.
# A follower that closes first may end it sooner (whether its close reaches us depends on the daemon: not measured)
JOIN_LINGER = 5.0
AVERAGED_CHUNK = 1 << 18  # elements per tensor handed to hivemind (1 MB; even the test models span several)

StateProvider = Callable[[], tuple[dict, Sequence[torch.Tensor]]]


@dataclass(frozen=True)
class AveragerLimits:
    """hivemind's construction-time limits. The all-reduce one is only an outer cap: each round's deadline
    comes from the link speed this peer measured (RoundClock.allreduce_budget), sent along in the gathered
    metadata and enforced in `_aggregate_with_group`, so it follows the network as it changes."""

    allreduce_cap: float
    next_chunk: float
    matchmaking: float  # hivemind's min_matchmaking_time: the floor of the grace window
    request: float
    initial_bytes_per_s: float  # link speed assumed until the first round has been measured


def averager_limits(n_elements: int, max_group: int, bandwidth_mbps: float, part_bytes: int = 1 << 19,
                    cpu_seconds_per_gb: float = 4.0) -> AveragerLimits:
    """From the payload size and the declared link: the butterfly moves 2·(N−1)/N·S bytes per peer, plus CPU
    time for (de)serialization (measured ~0.6 s per 40 MB with 2 peers on 2 cores)."""
    link = bandwidth_mbps * 1e6 / 8
    cpu_rate = 1e9 / (cpu_seconds_per_gb * max_group)
    effective = 1.0 / (1.0 / link + 1.0 / cpu_rate)
    expected = allreduce_wire_bytes(n_elements, max_group) / effective
    request = 2.0
    return AveragerLimits(allreduce_cap=math.ceil(30.0 + 10.0 * expected),
                          next_chunk=max(2.0, 10.0 * part_bytes / link), matchmaking=request + 0.5,
                          request=request, initial_bytes_per_s=effective)


class ExactAverager(DecentralizedAverager):
    """Merges one flat fp32 buffer, shared with the host.

    The host writes Δ into it, calls `step(weight=1, gather=...)`; on return it holds the exact token-weighted
    sum Σ wᵢΔᵢ when `result["verified"]` is True. Otherwise it holds nothing of use: the host keeps its Δ and
    writes it again for its next attempt (no model-sized copy of it here).
    """

    join_linger = JOIN_LINGER

    def __init__(self, n_elements: int, max_group: int, state_provider: StateProvider, weighting: str,
                 allreduce_cap: float, expect: Expect, bits: int = codec.BITS["none"], topk: Optional[float] = None,
                 bounds: Bounds = Bounds(), robust: bool = False, passes: Optional[MemberPasses] = None,
                 buffer_folder: Optional[Path] = None, **kwargs):
        self.n_elements, self.max_group, self.weighting, self.bounds = n_elements, max_group, weighting, bounds
        self.allreduce_cap, self.expect = allreduce_cap, expect
        self.bits = bits  # codes' width on the wire (swarm.codes)
        self.topk = topk  # send only this fraction of each block (codec.TopKFormat)
        self._codes = codes_exchange(n_elements, robust)
        self._state_provider = state_provider
        self._passes = passes  # a swarm with a key: who may join our group, be merged, fetch our state
        self._refused = PenaltyBox(seconds=REFUSE_SECONDS)  # members we turn away at matchmaking, for a while
        self._stragglers = Stragglers()  # members whose part came after our cut-off: blamed when late again
        # the host and our streams read and write the flat buffer as one, in a file mapped shared where a folder
        # is given (paged in a piece at a time), in shared memory otherwise: the forked process shares it either way
        self._paged = _paged_buffer(n_elements, buffer_folder)
        self._flat = self._paged.vectors[0] if self._paged is not None else torch.zeros(n_elements).share_memory_()
        super().__init__(hivemind_schema(self._flat), target_group_size=max_group, **kwargs)

    @contextlib.contextmanager
    def buffer(self):
        """The whole averaged buffer, under hivemind's tensor lock."""
        with self.get_tensors():
            yield self._flat

    def let_go(self, part: slice) -> None:
        """Let elements `part` of the buffer go from this process's memory, if it lives in a file (a pass over it
        calls this as it goes: the host's as it writes Δ and reads the sum, ours as pieces are coded and land)."""
        if self._paged is not None:
            self._paged.let_go(part)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> IslandReduced:
        try:
            reduced = await self._island_round(group_info)
        finally:  # the round's pieces and messages, freed into our heaps, go back to the kernel (runtime.heap)
            give_back_free_heap()
        self.refuse(reduced.blamed)  # those whose parts or sums failed us: not in groups we lead for a while
        return reduced

    async def _island_round(self, group_info) -> IslandReduced:
        island = parse_island([self._user_record(blob) for blob in group_info.gathered], self.expect,
                              [str(p) for p in group_info.peer_ids], self._passes.valid if self._passes else None)
        my_index = list(group_info.peer_ids).index(self.peer_id)
        clients = frozenset(i for i, blob in enumerate(group_info.gathered) if self._gathered_client(blob))
        plan = plan_island(island, self.weighting, self.allreduce_cap, self.n_elements, self.bounds, clients)
        started = time.monotonic()
        if plan.bounded:
            logger.warning(f"group {group_info.group_id.hex()[:8]}: bounded " + ", ".join(
                f"{island.members[i].name or island.members[i].peer[-6:]} ({why})" for i, why in plan.bounded.items()))
        if plan.relieved and plan.weights is not None:
            logger.info(f"group {group_info.group_id.hex()[:8]}: " + ", ".join(
                f"{island.members[i].name or island.members[i].peer[-6:]} {why}" for i, why in plan.relieved.items()))
        self._refuse_left_out(island, plan, group_info)
        if plan.weights is None:  # every member derives the same: nothing to merge, no tensor moves
            return self._reduced(island, plan, group_info, False, plan.reason, started)
        if my_index not in plan.included:  # the others merge without us; our Δ rides along next time
            return self._reduced(island, plan, group_info, False, "our contribution was not included", started)
        return await self._codes_round(island, plan, group_info, my_index, started)

    async def _codes_round(self, island, plan, group_info, my_index: int, started: float) -> IslandReduced:
        """Each member's w·Δ as b-bit codes on block scales agreed from the gathered statistics, summed exactly by
        our own streamed reduce-scatter and all-gather (p2pdiloco.swarm.codes)."""
        included = plan.included  # only they send and reduce parts: an excluded member's codes are never summed
        maxabs = [plan.maxabs[i].double() * plan.weights[i] for i in included]
        with self.buffer() as buffer:  # our Δ, read in place a piece at a time as the streams ask for its codes;
            vector = buffer[: self.n_elements]  # Σ wᵢΔᵢ lands there piece by piece as the sums come (the host
            # reads it only once we return, and writes Δ again for its next attempt if this one fails)
        scales = codec.agreed_scales(maxabs, self.bits)
        fmt = self.wire_format(len(included))
        # hivemind's contract at this seam (its PowerSGD averager does the same): the group's future holds the
        # runner that serves its all-reduce parts; ours has none, our parts travel through rpc_codes_*
        running = self._running_groups.get(group_info.group_id)
        if running is not None and not running.done():
            running.set_result(None)
        peers = [group_info.peer_ids[i] for i in included]
        reducers = [group_info.peer_ids[i] for i in plan.reducers]
        levels = codec.levels(self.bits)  # int2 agrees its scales from the mean |value|: no maximum to hold to
        claims = claims_for(plan, included, group_info.peer_ids, scales, levels, maxima=levels > 1)
        weights = {str(group_info.peer_ids[i]): plan.weights[i] for i in included}
        ours = Codes(self.n_elements, self._paged_after(functools.partial(
            _encode_piece, vector, plan.weights[my_index], scales, self.bits, fmt)))
        cpu = codec_cpu_seconds()
        try:
            exchanged = await self._codes.run(
                group_info.group_id, peers, reducers, self.peer_id, ours, fmt,
                lambda peer: self.get_stub(self._p2p, peer, namespace=self.prefix), plan.deadline, claims,
                land=self._paged_after(functools.partial(_land_piece, vector, scales, weights)))
        except Exception as e:  # a reducer that served no sum, a part we could not push: the round rolls back
            logger.warning(f"round in group {group_info.group_id.hex()[:8]} failed: {e!r}")
            failed = self._reduced(island, plan, group_info, False, f"all-reduce failed: {e}", started)
            blamed = self._blame(getattr(e, "culprits", ()), getattr(e, "dropped", {}), getattr(e, "late", ()))
            return dataclasses.replace(failed, blamed=blamed, codec_cpu_seconds=codec_cpu_seconds() - cpu)
        dropped = exchanged.dropped
        reduced = self._reduced(island, plan, group_info, True, "ok", started)
        if dropped:
            logger.warning(f"group {group_info.group_id.hex()[:8]}: left out of the part we reduce: {dropped}")
        return dataclasses.replace(reduced, codec_scales=scales, blamed=self._blame((), dropped),
                                   codec_cpu_seconds=codec_cpu_seconds() - cpu, excluded={
            **reduced.excluded, **{peer: f"left out of our part: {why}" for peer, why in dropped.items()}})

    def _paged_after(self, piece_work):
        """`piece_work(start, end, ...)`, then that piece of the buffer let go: a round keeps only the pieces in
        hand in memory, not the buffer."""
        def work(start: int, end: int, *args):
            try:
                return piece_work(start, end, *args)
            finally:
                self.let_go(slice(start, end))
        return work

    def wire_format(self, group_size: int):
        if self.topk:
            return codec.TopKFormat(self.bits, group_size, self.topk)
        return codec.DenseFormat(self.bits, group_size)

    async def rpc_codes_push(self, requests: AsyncIterator[averaging_pb2.DownloadData],
                             context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """A member's packed codes of the part we reduce (p2pdiloco.swarm.codes)."""
        yield await self._codes.push_answer(requests, str(context.remote_id))

    async def rpc_codes_fetch(self, requests: AsyncIterator[averaging_pb2.DownloadData],
                              context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The exact sum of the part we reduce, once every member's codes arrived; open until the fetcher has it."""
        async for answer in self._codes.fetch_answers(requests, self.allreduce_cap, str(context.remote_id)):
            yield answer

    def _blame(self, culprits, dropped: dict, late_reducers=()) -> frozenset:
        """Whom this round is blamed on: reducers that failed it, senders we left out of our part for what they
        sent, and those, senders or reducers, that came late and were late not long ago (protocol.island.Stragglers)."""
        faults, late = faults_and_late(dropped)
        return frozenset(culprits) | faults | self._stragglers.late(late | frozenset(late_reducers), time.monotonic())

    def _refuse_left_out(self, island, plan, group_info) -> None:
        """Members the island rejected (a malformed record) or left out (blamed by most): turned away at
        matchmaking for a while, by the id libp2p authenticated (their records' ids cannot be trusted)."""
        refused = [str(group_info.peer_ids[i]) for i in range(len(island.members))
                   if (island.members[i] is None or i in plan.left_out) and group_info.peer_ids[i] != self.peer_id]
        self._refused.blame(refused, time.monotonic())

    def refuse(self, peers) -> None:
        """Turn these members away at matchmaking for a while (those whose parts or sums failed our round)."""
        self._refused.blame([p for p in peers if p != str(self.peer_id)], time.monotonic())

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """As hivemind's leader, unless the follower is one we turn away: it then looks for another leader."""
        follower = str(context.remote_id)
        if follower in self._refused.active(time.monotonic()) or not self._admits(follower, request.gather):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for message in super().rpc_join_group(request, context):
            yield message
        # Returning at once let our libp2p daemon reset the stream under that last message (it resets a stream whose
        # handler closed while it still reads the other way, and the reset drops what the follower's daemon has not
        # read): the follower never learnt of a group the others then ran with it as a reducer, and they waited out
        # the round's deadline (one round of 4 on the testbed: 29 s). Bounded, off the round's path.
        await asyncio.sleep(self.join_linger)

    def _admits(self, peer: str, gathered: bytes) -> bool:
        """In a swarm with a key: whether what a follower gathers carries its valid pass."""
        if self._passes is None:
            return True
        record = self._user_record(gathered)
        return isinstance(record, dict) and self._passes.valid(peer, record.get("pass"))

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's reducer RPC: our rounds never use it, so no part a stranger streams here is read or summed."""
        yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)

    def _gathered_client(self, blob: bytes) -> bool:
        """Whether a member said it is in client mode (hivemind's own field: its all-reduce reads it too)."""
        try:
            return self.serializer.loads(blob)[1] == AveragingMode.CLIENT.value
        except Exception:  # undecodable: its record is rejected anyway
            return False

    def _user_record(self, blob: bytes):
        """The record a member gathered (hivemind wraps it in (bandwidth, mode, user)); None if undecodable."""
        try:
            return self.serializer.loads(self.serializer.loads(blob)[2])
        except Exception:  # garbage from a remote peer: rejected by the parser with a reason
            return None

    @staticmethod
    def _reduced(island, plan, group_info, verified: bool, reason: str, started: float) -> IslandReduced:
        accepted = [i for i, m in enumerate(island.members) if m is not None and i not in plan.left_out]
        weights = tuple(plan.weights[i] for i in accepted) if plan.weights else ()
        excluded = {**island.excluded_by_index(), **{island.members[i].peer: why for i, why in plan.left_out.items()}}
        return IslandReduced(verified=verified, reason=reason, members=tuple(island.members[i] for i in accepted),
                             weights=weights, group_id=group_info.group_id.hex(),
                             sync_seconds=time.monotonic() - started, sync_ended=time.time(),
                             deadline=plan.deadline, excluded=excluded,
                             bounded={island.members[i].peer: why for i, why in plan.bounded.items()})

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind==1.1.12 sets SIGINT to ignored in the *host* process here, before starting the child, so a
        peer would never see Ctrl-C again; the child ignores it in `run` instead (a Ctrl-C is for the peer,
        which leaves in order and shuts us down)."""
        self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._inner_pipe = WholeMessagePipe(self._inner_pipe)  # this (the averager) process's end only
        super().run()

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's whole-state download, whose request has no room for a pass: in a swarm with a key it is
        refused (an empty answer sends the requester on to the next donor), and peers fetch by parts instead."""
        if self._passes is not None:
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def rpc_state_part(self, request: averaging_pb2.DownloadData,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """One part of our global state for a joiner fetching from several donors (swarm.statefetch)."""
        if self._passes is not None and not self._passes.valid(str(context.remote_id), request_pass(request)):
            yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(
                error="no valid pass: this swarm's state goes only to peers that hold its key")))
            return
        async for message in self._serve_part(request, context):
            yield message

    def _serve_part(self, request: averaging_pb2.DownloadData, context: P2PContext):
        """The messages of one part we serve, once the requester was let in."""
        if getattr(self, "_part_server", None) is None:
            # hivemind==1.1.12's own channel from the averager process to the host's get_current_state
            self._part_server = PartServer(self._get_current_state_from_host_process)
        return self._part_server.serve_part(request)

    def get_current_state(self):
        """Runs in the host process when a peer downloads our state (late join, resync)."""
        metadata, tensors = self._state_provider()
        return metadata, list(tensors), None


class WholeMessagePipe:
    """The averager process's end of hivemind's command pipe, read one whole message at a time.

    hivemind==1.1.12 watches this pipe with uvloop's `add_reader`, which leaves its descriptor non-blocking, and
    multiprocessing writes a message over 16 KiB as two writes (length, then body). A read that falls between
    them raises EAGAIN midway through a message; hivemind logs it and reads on from the middle of the stream,
    and the averager's command loop dies (seen with the 100M model, whose gathered block maxima take 24 KB, on
    a loaded machine: the peer never averaged again). `poll()` has said a message is arriving and its sender
    writes the rest at once, so reading it in blocking mode waits microseconds, not a round."""

    def __init__(self, connection):
        self._connection = connection

    def recv(self):
        fd = self._connection.fileno()
        was_blocking = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            return self._connection.recv()
        finally:
            os.set_blocking(fd, was_blocking)

    def __getattr__(self, name):  # fileno, poll, send, close: the connection's own
        return getattr(self._connection, name)


def codes_exchange(n_elements: int, robust: bool) -> CodesExchange:
    """A push's bytes may not exceed the whole model's codes at 24 bits: the widest dense codes (20) or top-k pairs
    (a 14-bit index and the code) of any fraction a swarm would pick, plus a tag per piece (a part's pieces can be
    no more than the whole model's)."""
    pieces = len(piece_ranges(0, n_elements))
    return CodesExchange(max_payload=codec.packed_bytes(n_elements, 24) + 1024 + pieces, robust=robust,
                         max_pieces=pieces)


def _encode_piece(delta: torch.Tensor, weight: float, scales: torch.Tensor, bits: int, fmt, start: int,
                  end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our codes of [start, end), a block-aligned piece: the same bits as the whole vector's codes there (codes
    and top-k selection are per block). Read from the buffer before that piece's sum can land there: a sum needs
    our codes, or was made without them (then what we send for it is ignored)."""
    first = start // codec.BLOCK
    enc = codec.encode(delta[start:end], weight, scales[first:first + codec.n_blocks(end - start)], bits, fmt,
                       with_sent=False)
    return enc.codes, enc.selected


def _land_piece(merged: torch.Tensor, scales: torch.Tensor, weights: dict, start: int, end: int,
                total: torch.Tensor, left_out: frozenset) -> None:
    """One piece's exact sum of codes, dequantized into the buffer and scaled back to a weighted mean if its
    reducer left senders out. Pieces start on block boundaries (swarm.codes)."""
    first = start // codec.BLOCK
    codec.dequantize(total, scales[first:first + codec.n_blocks(end - start)], out=merged[start:end])
    reweigh(merged[start:end], left_out, weights)


def claims_for(plan, senders: Sequence[int], peer_ids: Sequence, scales: torch.Tensor, limit: int,
               maxima: bool = True) -> dict[str, Claims]:
    """Sender peer id → its claims in code units, for the plan's included `senders` (group indices)."""
    return {str(peer_ids[i]): claims_in_codes(plan.maxabs[i], plan.clipped[i], plan.norms[i], plan.weights[i],
                                              scales, limit, maxima) for i in senders}


def reweigh(piece: torch.Tensor, left_out: frozenset, weights: dict) -> None:
    """A piece some senders were left out of sums the others' weights only: scale it back to the weights' total
    (1, but where stale members were discounted: p2pdiloco.protocol.island). The names come from the piece's
    reducer, the same for every member, so every member gets the same bits."""
    kept = sum(w for peer, w in weights.items() if peer not in left_out)  # dict order: the group's, everywhere
    if left_out and kept > 0:
        piece.mul_(torch.tensor(sum(weights.values()) / kept, dtype=torch.float32))


def hivemind_schema(buffer: torch.Tensor) -> list[torch.Tensor]:
    """What hivemind gets as its averaged tensors: the buffer's 1 MB views' shapes, without their memory.
    Its matchmaking takes only followers whose tensors' shapes hash like the leader's (the same hash as the
    views themselves: peers of earlier versions handed those); it never reads their values, since our rounds
    travel through rpc_codes_* and our state through rpc_download_state. It would move real views into
    /dev/shm (share_memory_ under its file_system strategy), copying a buffer that lives in a file."""
    shape_only = torch.zeros(1)  # one element for all: share_memory_ moves 4 bytes, once
    return [shape_only.expand(view.shape) for view in buffer.split(AVERAGED_CHUNK)]


def _paged_buffer(n: int, folder: Optional[Path]) -> Optional[FileVectors]:
    """The buffer in a file of `folder` (None: in memory; also where the folder cannot hold it, saying so)."""
    if folder is None:
        return None
    try:
        return FileVectors(n, 1, folder, prefix="averaging-")
    except (OSError, ValueError) as e:
        logger.warning(f"cannot keep the averaging buffer in {folder} ({e}): it stays in memory ({4 * n / 1e9:.2f} GB)")
        return None


class BodyStatistics:
    """What our gathered record says of what we send, per block: the statistic the wire format agrees its scales
    from (the block maximum, but for int2) and the block norms that bound what our codes may hold
    (p2pdiloco.core.claims). Per block, so a pass can add them a chunk of whole blocks at a time, with the same
    bits as over the whole vector, and let each chunk of the buffer go once done."""

    def __init__(self, n: int, wire_format: codec.DenseFormat):
        self.wire_format = wire_format
        self.statistic = torch.empty(codec.n_blocks(n), dtype=torch.float32)
        self.norms = torch.empty(codec.n_blocks(n), dtype=torch.float32)

    def add(self, piece: torch.Tensor, blocks: slice) -> None:
        """`piece`: whole blocks `blocks` of the vector (the last may be short: the vector's own end)."""
        self.statistic[blocks] = self.wire_format.block_statistic(piece)
        self.norms[blocks] = block_norms(piece)

    @classmethod
    def of(cls, body: torch.Tensor, wire_format: codec.DenseFormat) -> "BodyStatistics":
        statistics = cls(body.numel(), wire_format)
        statistics.add(body, slice(0, None))
        return statistics


def gather_record(peer: str, name: str, version: int, tokens: int, steps: int, statistics: BodyStatistics,
                  digest: str, budget: float, norms: Sequence[float] = (), blame: Sequence[str] = (),
                  credential: bytes = b"") -> dict:
    """This member's metadata for the round, all-gathered during matchmaking (kept small: ~4 bytes per
    16K parameters for each block statistic, one float per tensor for RDA norms)."""
    return dict(peer=peer, name=name, version=version, tokens=int(tokens), steps=int(steps), digest=digest,
                budget=float(budget), norms=[float(x) for x in norms], maxabs=statistics.statistic.numpy().tobytes(),
                block_norms=statistics.norms.numpy().tobytes(),
                blame=list(blame), **({"pass": credential} if credential else {}))
