"""What runs in the averager's own process (hivemind forks it from the peer): the island's round once
matchmaking formed a group, and the RPCs other peers call. `IslandRounds` is mixed into
p2pdiloco.swarm.averager.ExactAverager, whose other methods are what the host calls. Every hook on hivemind
below its public API is listed with its test in p2pdiloco.swarm.seams.

- `_aggregate_with_group` runs after matchmaking, with the group's gathered metadata in hand and before any
  tensor moves. We plan the island from the gathered records (p2pdiloco.protocol.island), encode the
  pseudo-gradient as integer codes on block scales the group agrees on, and sum them exactly with our own streamed
  reduce-scatter and all-gather over hivemind's libp2p streams (p2pdiloco.swarm.codes; `rpc_codes_*`).
- `rpc_join_group` (hivemind's leader RPC): members rejected, left out or blamed lately are turned away.
- `rpc_state_part`: a part of our global state, for joiners fetching from several donors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import time
from typing import AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.core import codec
from p2pdiloco.core.claims import Claims, claims_in_codes
from p2pdiloco.protocol.island import plan_island
from p2pdiloco.protocol.merge import encode_piece, group_scales, land_piece
from p2pdiloco.protocol.remote import parse_island
from p2pdiloco.protocol.round import IslandReduced
from p2pdiloco.runtime.heap import give_back_free_heap
from p2pdiloco.runtime.pace import UploadPace
from p2pdiloco.swarm.codes import Codes, CodesExchange, codec_cpu_seconds, faults_and_late, piece_ranges
from p2pdiloco.swarm.statefetch import PartServer, request_pass

logger = get_logger(__name__)

REFUSE_SECONDS = 120.0  # a member rejected from our island, or blamed by us, is turned away this long when it
# asks to join our group (it may still lead a group we join: then the island leaves it out again)
# a leader's join stream stays open this long after its last message (the group to run with): see rpc_join_group.
# A follower that closes first may end it sooner (whether its close reaches us depends on the daemon: not measured)
JOIN_LINGER = 5.0


class IslandRounds:
    """The averager process's half of ExactAverager (see the module's docstring)."""

    join_linger = JOIN_LINGER
    # the peers we do not follow, read by `get_stub` (a classmethod: hivemind asks the class): set in the averager's
    # own process when it starts, where this instance is the only averager (each fragment's runs in its own process)
    _not_to_follow: Optional[Callable[[], frozenset]] = None

    @classmethod
    def get_stub(cls, p2p, peer, *, namespace: Optional[str] = None):
        """hivemind's matchmaking asks our class for a leader's stub before it asks to join the leader's group
        (Matchmaking(servicer_type=type(averager)), hivemind==1.1.12). A leader our island left out lately (blamed by
        most of it, or its record rejected) we do not follow: every island it leads leaves it out again, so an honest
        peer alone with it merged nothing that round, and honest peers split between two such groups formed islands
        apart (a fork). One that only we blame we still follow: the others still merge it, and declining would split
        us from them. Every other call is the stub's own (our rounds' rpc_codes_* included)."""
        stub = super().get_stub(p2p, peer, namespace=namespace)
        not_to_follow = cls._not_to_follow
        if not_to_follow is not None and str(peer) in not_to_follow():
            return NotFollowing(stub)
        return stub

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> IslandReduced:
        try:
            reduced = await self._island_round(group_info)
        finally:  # the round's pieces and messages, freed into our heaps, go back to the kernel (runtime.heap)
            give_back_free_heap()
        self.refuse(reduced.blamed)  # those whose parts or sums failed us: not in groups we lead for a while
        return reduced

    async def _island_round(self, group_info) -> IslandReduced:
        island, plan = self._planned(group_info)
        my_index = list(group_info.peer_ids).index(self.peer_id)
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

    def _planned(self, group_info):
        """The group's records parsed and its island planned, as every member of it does (logged here)."""
        modes = [self._gathered_mode(blob) for blob in group_info.gathered]
        island = parse_island([self._user_record(blob) for blob in group_info.gathered], self.expect,
                              [str(p) for p in group_info.peer_ids], self._passes.valid if self._passes else None,
                              nodes=frozenset(i for i, m in enumerate(modes) if m == AveragingMode.AUX.value))
        clients = frozenset(i for i, m in enumerate(modes) if m == AveragingMode.CLIENT.value)
        plan = plan_island(island, self.weighting, self.allreduce_cap, self.n_elements, self.bounds, clients)
        return island, plan

    async def _codes_round(self, island, plan, group_info, my_index: int, started: float) -> IslandReduced:
        """Each member's w·Δ as b-bit codes on block scales agreed from the gathered statistics, summed exactly by
        our own streamed reduce-scatter and all-gather (p2pdiloco.swarm.codes)."""
        included = plan.included  # only they send and reduce parts: an excluded member's codes are never summed
        with self.buffer() as buffer:  # our Δ, read in place a piece at a time as the streams ask for its codes;
            vector = buffer[: self.n_elements]  # Σ wᵢΔᵢ lands there piece by piece as the sums come (the host
            # reads it only once we return, and writes Δ again for its next attempt if this one fails)
        scales = group_scales(plan, self.bits)
        fmt = self.wire_format(len(included))
        # hivemind's contract at this seam (its PowerSGD averager does the same): the group's future holds the
        # runner that serves its all-reduce parts; ours has none, our parts travel through rpc_codes_*
        running = self._running_groups.get(group_info.group_id)
        if running is not None and not running.done():
            running.set_result(None)
        peers = [group_info.peer_ids[i] for i in included]
        reducers = [group_info.peer_ids[i] for i in plan.reducers]
        levels = codec.levels(self.bits)  # int2 agrees its scales from the mean |value|: no maximum to hold to
        claims = claims_for(plan, included, group_info.peer_ids, scales, levels, maxima=levels > 1,
                            floor=not self.topk)
        weights = {str(group_info.peer_ids[i]): plan.weights[i] for i in included}
        ours = Codes(self.n_elements, self._paged_after(functools.partial(
            encode_piece, vector, plan.weights[my_index], scales, self.bits, fmt)))
        cpu = codec_cpu_seconds()
        try:
            exchanged = await self._codes.run(
                group_info.group_id, peers, reducers, self.peer_id, ours, fmt,
                lambda peer: self.get_stub(self._p2p, peer, namespace=self.prefix), plan.deadline, claims,
                land=self._paged_after(functools.partial(land_piece, vector, scales, weights)))
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
                   if (island.members[i] is None and i not in island.nodes or i in plan.left_out)
                   and group_info.peer_ids[i] != self.peer_id]
        self._refused.blame(refused, time.monotonic())
        self._left_out.blame(refused, time.monotonic())  # nor do we follow them (`get_stub`)

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

    def _gathered_mode(self, blob: bytes):
        """The mode a member said it is in (hivemind's own field: its all-reduce reads it too): client (nobody
        can dial it), auxiliary (a reducer node), or a plain member; None if undecodable (its record is rejected)."""
        try:
            return self.serializer.loads(blob)[1]
        except Exception:
            return None

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
                             deadline=plan.deadline, excluded=excluded, tokens=plan.tokens,
                             bounded={island.members[i].peer: why for i, why in plan.bounded.items()})

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._inner_pipe = WholeMessagePipe(self._inner_pipe)  # this (the averager) process's end only
        type(self)._not_to_follow = lambda: self._left_out.active(time.monotonic())  # `get_stub`'s, in this process
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

    async def rpc_state_push(self, requests: AsyncIterator[averaging_pb2.DownloadData],
                             context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """A state pushed for a peer that needs it: only a reducer node takes one (p2pdiloco.swarm.staterelay)."""
        yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(error="this peer relays no state")))

    def _serve_part(self, request: averaging_pb2.DownloadData, context: P2PContext):
        """The messages of one part we serve, once the requester was let in."""
        if getattr(self, "_part_server", None) is None:
            # hivemind==1.1.12's own channel from the averager process to the host's get_current_state
            self._part_server = PartServer(self._get_current_state_from_host_process)
        return self._part_server.serve_part(request)


class NotFollowing:
    """A leader's stub whose join requests it declines itself, as a leader not looking for a group would: hivemind's
    matchmaking then asks the next potential leader (or leads). Everything else is the stub's own."""

    def __init__(self, stub):
        self._stub = stub

    async def rpc_join_group(self, request, *args, **kwargs):
        async def declined():
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        return declined()

    def __getattr__(self, name):
        return getattr(self._stub, name)


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


def codes_exchange(n_elements: int, robust: bool, pace: Optional[UploadPace] = None) -> CodesExchange:
    """A push's bytes may not exceed the whole model's codes at 24 bits: the widest dense codes (20) or top-k pairs
    (a 14-bit index and the code) of any fraction a swarm would pick, plus a tag per piece (a part's pieces can be
    no more than the whole model's)."""
    pieces = len(piece_ranges(0, n_elements))
    return CodesExchange(max_payload=codec.packed_bytes(n_elements, 24) + 1024 + pieces, robust=robust,
                         max_pieces=pieces, pace=pace)


def claims_for(plan, senders: Sequence[int], peer_ids: Sequence, scales: torch.Tensor, limit: int,
               maxima: bool = True, floor: bool = False) -> dict[str, Claims]:
    """Sender peer id → its claims in code units, for the plan's included `senders` (group indices); `floor`:
    their codes held to the norm their claims back from below too (dense formats)."""
    return {str(peer_ids[i]): claims_in_codes(plan.maxabs[i], plan.clipped[i], plan.norms[i], plan.weights[i],
                                              scales, limit, maxima, plan.backing[i] if floor else None)
            for i in senders}
