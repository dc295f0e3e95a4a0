"""The hivemind driver of the round protocol (p2pdiloco.protocol.round), run from DiLoCo's background thread.

The protocol decides; this module only does what it is told: reads peer records from the DHT, downloads states,
and runs an island through the exact averager, reporting each result back as the next event. A hivemind failure
is reported as a typed result (no island formed, or the all-reduce failed), never as matched error text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter
from concurrent.futures import InvalidStateError
from typing import TYPE_CHECKING, Callable, Optional

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from p2pdiloco.core import codec
from p2pdiloco.core.exact import blockwise
from p2pdiloco.core.outer import rda_directions
from p2pdiloco.core.reach import RefusedKeys
from p2pdiloco.core.state import sharing_priority
from p2pdiloco.protocol.outcomes import Contribution, RoundOutcome, Solo, StateTuple
from p2pdiloco.protocol.island import PenaltyBox
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.protocol.download import GiveUp, StateDownload
from p2pdiloco.protocol.round import (Done, Download, FormIsland, IslandFailed, IslandReduced, IslandResult,
                                      NoIsland, RefreshPeers, Round, WaitForPeers)
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.runtime.heap import give_back_free_heap
from p2pdiloco.runtime.procio import io_counters, moved_since
from p2pdiloco.runtime.waiting import result_unless_closed
from p2pdiloco.swarm.averager import BodyStatistics, ExactAverager, gather_record
from p2pdiloco.swarm.records import TTL, Heartbeat, LaneBeat, fetch_reducers, other_wires
from p2pdiloco.swarm.statefetch import StateFetcher
from p2pdiloco.swarm.staterelay import StatePusher, want_state

if TYPE_CHECKING:  # swarm.wiring builds us
    from p2pdiloco.swarm.wiring import MergeSettings, WhyNotAdopt

logger = get_logger(__name__)
RELAY_WAIT = 60.0  # seconds a state relayed through a reducer node may take to come (its holder pushes, we fetch)
RELAY_RETRY = 1.0  # seconds between asks, until its holder has pushed it
RELAY_PER_NODE = 15.0  # seconds we ask one reducer node for the state before we ask the next
NOBODY_REDUCES = ("no island can form: this peer and every live peer are in client mode (nobody can dial them) "
                  "and no reducer node is up; training on alone. Fix: a public peer, or `p2pdiloco bootstrap "
                  "--reduce` on a public machine (docs/internet.md)")


class SwarmMerger:
    """Runs our rounds and state downloads over hivemind (p2pdiloco.swarm.wiring builds it, whole)."""

    def __init__(self, settings: MergeSettings, dht: DHT, averager: ExactAverager, heartbeat: Heartbeat | LaneBeat,
                 fetcher: StateFetcher, feedback: Optional[codec.ErrorFeedback], why_not_adopt: WhyNotAdopt,
                 stop: threading.Event, clock: RoundClock, pusher: Optional[StatePusher] = None):
        self.settings, self.dht, self.averager, self.heartbeat = settings, dht, averager, heartbeat
        self.fetcher, self.pusher = fetcher, pusher  # pusher: a client's state, to a reducer node for a peer in need
        self.feedback, self.why_not_adopt, self.stop, self.clock = feedback, why_not_adopt, stop, clock
        self.penalties = PenaltyBox()  # whom we blame for failed rounds: gathered with our record
        self.refused = RefusedKeys()  # states we downloaded and would not take (p2pdiloco.core.reach)
        self.closed = threading.Event()  # set on shutdown: a round still waiting gives up at once
        self._control = None  # the averager step of the round in flight, once it is looking for a group
        self._said_nobody_reduces = False

    @property
    def cfg(self):
        return self.settings.cfg

    @property
    def outer(self):
        return self.settings.outer

    @property
    def n(self) -> int:
        return self.settings.n

    @property
    def peer(self) -> str:
        return self.settings.peer

    # ---- the round: the protocol decides, we do ----------------------------------------------------------
    def merge(self, c: Contribution) -> RoundOutcome:
        try:
            outcome = self._drive(Round(self.settings.rules, self.peer, c, self.clock, time.monotonic()))
        finally:
            # `merging` stays until the outcome's state is published (below). A store of its own: riding in that
            # store instead cut 15-20 % of a peer's stores, but the chaos tool's failure-free runs then forked more
            # (docs/fragments.md, "A store less per round, tried")
            self.heartbeat.update(ready=-1)
        return self._solo(c, outcome) if isinstance(outcome, Solo) else outcome

    def _solo(self, c: Contribution, outcome: Solo) -> Solo:
        """Alone, our own update is the merge. It goes into the averaging buffer a chunk at a time (no island
        uses it now), each chunk let go once written and again once the outer step read it, where the buffer
        lives in a file: no model-sized copy of Δ. With error feedback (and no RDA), what our wire would have
        carried (codec.ErrorFeedback.alone), not our whole Δ."""
        source = c.kept.parts()  # Δ, a slice at a time from where it waits (under RDA too: its solo merges Δ)
        with self.averager.buffer() as buffer:
            merged = buffer[: self.n]
            if self.feedback is not None and not self.outer.rda:
                self.feedback.alone(source, self.settings.bits, self.averager.wire_format(1), out=merged,
                                    let_go=self.averager.let_go)
            else:
                for part, _ in blockwise(self.n):
                    merged[part] = source[part]
                    self.averager.let_go(part)
        return dataclasses.replace(outcome, merged=merged, let_go=self.averager.let_go)

    def _drive(self, rnd: Round) -> RoundOutcome:
        decision, traffic = rnd.start(self.live_others(), time.monotonic()), {}
        while not isinstance(decision, Done):
            if isinstance(decision, Download):
                decision = rnd.on_state(self.download(decision.min_version, decision.why), time.monotonic())
            elif isinstance(decision, WaitForPeers):
                decision = self._wait(rnd, decision)
            elif isinstance(decision, RefreshPeers):
                decision = rnd.on_peers(self.live_others(), time.monotonic())
            elif isinstance(decision, FormIsland):
                io_before = io_counters(self.averager.pid)
                result = self._island(rnd.c, decision)
                traffic = self._traffic(io_before)
                decision = (rnd.on_leaving(time.monotonic(), "leaving: the round was cancelled") if result is None
                            else rnd.on_island(result, time.monotonic()))
            else:
                raise TypeError(f"unknown decision {decision!r}")
        return dataclasses.replace(decision.outcome, **traffic)

    def _wait(self, rnd: Round, waiting: WaitForPeers):
        """Announce that we are ready and poll the peer records until the protocol stops waiting."""
        self.heartbeat.update(ready=waiting.ready_version)
        while True:
            if self.stop.is_set():
                return rnd.on_leaving(time.monotonic())
            decision = rnd.on_peers(self.live_others(poll=True), time.monotonic())
            if not isinstance(decision, WaitForPeers):
                return decision
            time.sleep(max(0.0, min(decision.poll, decision.until - time.monotonic())))

    def other_wires(self) -> Counter:
        """Live peers of another wire version, by version (p2pdiloco.protocol.compat.wire_mismatch)."""
        return other_wires(self.dht, self.cfg.run_id)

    def live_others(self, poll: bool = False) -> list[PeerRecord]:
        """Every other live peer's record, but those announcing a state we refused: not donors, and no reason to
        catch up or wait. `poll`: as a round waiting for peers reads them (`Heartbeat.poll`)."""
        refused = self.refused.active(time.monotonic())
        records = self.heartbeat.poll() if poll else self.heartbeat.fetch()
        return [r for r in records if r.peer != self.peer and r.key not in refused]

    def _start_in(self, island: FormIsland) -> float:
        """When we offer to begin the all-reduce, in seconds from now. hivemind's followers join only leaders that
        begin no later than they offered. A peer in client mode never leads, so offering the end of its grace
        window would shut it out of every island whose leader arrived after it; it offers the latest start its
        search allows instead, and joins whichever island begins first."""
        if self.cfg.client_mode:
            return island.find_timeout - self.settings.limits.request
        return island.grace

    def _island(self, c: Contribution, island: FormIsland) -> Optional[IslandResult]:
        """Run one island attempt; None if we are leaving."""
        gather = self._load_buffer(c, island)
        give_back_free_heap()  # that pass's chunk temporaries, freed: not resident while the all-reduce runs
        control = self._control = self.averager.step(
            gather=gather, weight=1.0, timeout=island.find_timeout, scheduled_time=get_dht_time() + self._start_in(island),
            allow_retries=False, wait=False)
        try:
            result = result_unless_closed(control, island.result_timeout, self.closed.is_set,
                                          on_poll=merging_announcer(control, self.heartbeat, c.version))
        except Exception as e:  # CancelledError too: we left while looking for an island
            began = control.began_allreduce
            cancel(control)
            if self.stop.is_set():
                return None
            reason = f"{type(e).__name__}: {e}"
            if not began:
                self._say_if_nobody_reduces()
            return IslandFailed(reason) if began else NoIsland(reason)
        finally:
            self._control = None
        if not isinstance(result, IslandReduced):
            return IslandFailed(f"the averager returned {type(result).__name__}")
        if result.blamed:
            logger.warning(f"blaming {', '.join(p[-6:] for p in sorted(result.blamed))} for this round "
                           f"({result.reason}); islands leave out a member that most of its members blame")
            self.penalties.blame(result.blamed, time.monotonic())
        if not result.verified:
            return result
        if self.feedback is not None and result.codec_scales is not None:
            self._record_feedback(c, result)
            give_back_free_heap()  # its pass's temporaries, as after `_load_buffer`
        with self.averager.buffer() as buffer:
            # a view, not a copy: the host applies it before its next round writes the buffer again (DiLoCo keeps
            # a copy only for eager estimates)
            return dataclasses.replace(result, merged=buffer[: self.n], let_go=self.averager.let_go)

    def _say_if_nobody_reduces(self) -> None:
        """Once, in one line: we are in client mode and so is every live peer, and no reducer node is up. Then no
        island can form (nobody can be dialled to reduce a part, nor lead a group): we train on alone."""
        if self._said_nobody_reduces or not self.cfg.client_mode:
            return
        try:
            if any(not r.client_mode for r in self.live_others()) or fetch_reducers(self.dht, self.cfg.run_id):
                return
        except Exception:  # the DHT did not answer: nothing to say yet
            return
        self._said_nobody_reduces = True
        logger.warning(NOBODY_REDUCES)

    def _load_buffer(self, c: Contribution, island: FormIsland) -> dict:
        """Write what we send into the averaging buffer; our gathered record. Nothing here holds Δ while the
        round runs: the buffer has it, and the host keeps its own on disk (error feedback reads it back after).
        One pass, a chunk of whole blocks at a time: each chunk is read, compensated and measured, then let go
        (where the buffer lives in a file), so the buffer is never all in our memory."""
        statistics = BodyStatistics(self.n, self.averager.wire_format(1))
        with self.averager.buffer() as buffer:  # the averager reads it only once we step: ours until then
            body = buffer[: self.n]
            # without RDA, Δ a slice at a time from where it waits: no model-sized copy of it on its way here
            source, norms = self._uncompensated(c) if self.outer.rda else (c.kept.parts(), [])
            for part, blocks in blockwise(self.n):
                piece = body[part]
                piece.copy_(source[part])
                if self.feedback is not None:
                    self.feedback.compensate_(piece, part)
                statistics.add(piece, blocks)
                self.averager.let_go(part)
            del source
        return gather_record(self.peer, c.name, c.version, c.tokens, c.steps, statistics, c.digest,
                             island.budget, norms, blame=self.penalties.active(time.monotonic()),
                             credential=self.settings.credential)

    def _uncompensated(self, c: Contribution) -> tuple[torch.Tensor, list]:
        """Our contribution as sent before error feedback: Δ, or its RDA directions (and their norms)."""
        return rda_directions(c.delta, self.settings.segments) if self.outer.rda else (c.delta, [])

    def _contribution_parts(self, c: Contribution):
        """What `_uncompensated` gives, to read a slice at a time where it can be (Δ itself, without RDA)."""
        return self._uncompensated(c)[0] if self.outer.rda else c.kept.parts()

    def _record_feedback(self, c: Contribution, result: IslandReduced) -> None:
        """What of our compensated contribution reached the sum: the same codes the averager sent, decoded."""
        weight = next((w for m, w in zip(result.members, result.weights) if m.peer == self.peer), 0.0)
        if weight > 0:
            fmt = self.averager.wire_format(sum(w > 0 for w in result.weights))  # the members that sent codes
            self.feedback.record_encoded(self._contribution_parts(c), weight, result.codec_scales, self.settings.bits,
                                         fmt)

    def _traffic(self, before) -> dict:
        """What this round really moved (failed rounds too), measured on our averager process."""
        moved = moved_since(self.averager.pid, before)
        return {} if moved is None else dict(bytes_sent=moved.written, bytes_received=moved.read)

    def leave_round(self) -> bool:
        """The peer is leaving: cancel the round in flight if it is still looking for an island (no member
        depends on our data yet), and say so. A round already exchanging tensors is left to finish: leaving
        it would make the whole island roll back."""
        control = self._control
        if control is None or control.began_allreduce:
            return False
        cancel(control)
        return True

    # ---- global state from peers --------------------------------------------------------------------------
    def download(self, min_version: int, why: str, timeout: Optional[float] = None) -> Optional[StateTuple]:
        """The newest state from the swarm, at least `min_version`, validated and within reach of ours, by the
        rules of p2pdiloco.protocol.download: from every donor of the best key at once, retried until they say
        to give up."""
        deadline = time.monotonic() + (timeout or max(10.0, self.settings.limits.allreduce_cap))
        rules = StateDownload(min_version, self.n, deadline, self.refused, self.penalties, self.why_not_adopt,
                              gone_after=TTL)
        while True:
            donors = rules.donors(self.live_others(), time.monotonic())
            loaded, served = self._from_donors(donors, rules.deadline) if donors is not None else \
                self._through_node(rules)
            if loaded is None and rules.may_fetch_whole(donors, self.settings.passes is not None) \
                    and not self._stopping():
                loaded, served = self.load_state(timeout=max(1.0, rules.deadline - time.monotonic())), []
            refused_before = len(rules.refusals)
            problem = rules.judge(loaded, served, self.live_others(), time.monotonic())
            for refusal in rules.refusals[refused_before:]:
                logger.warning(refusal)
            if problem is None:
                return loaded
            step = rules.after_failure(problem, self.live_others(), time.monotonic(), self._stopping())
            if isinstance(step, GiveUp):
                logger.info(f"state download ({why}) failed: {step.reason}")
                return None
            time.sleep(step.after)

    def _from_donors(self, chosen: Optional[tuple[tuple[int, str], list[str]]],
                     deadline: float) -> tuple[Optional[StateTuple], list[str]]:
        """In parts from every donor of the best state key (p2pdiloco.protocol.download.state_donors), resuming past donors that fail; the
        state and the donors that served it."""
        if chosen is None:
            return None, []
        best, donors = chosen
        started = time.monotonic()
        try:
            t = self.fetcher.fetch(donors, best, 2 * self.n, timeout=max(1.0, deadline - time.monotonic()),
                                   leaving=self._stopping)
        except Exception as e:  # every donor failed, or time ran out: the caller falls back
            logger.info(f"state from {len(donors)} donor(s) failed: {type(e).__name__}: {e}")
            return None, []
        failed = f"; {t.requeued_parts} part(s) re-fetched after {sorted(t.failed_donors)} failed" \
            if t.failed_donors else ""
        logger.info(f"state v{best[0]} from {len(donors)} donor(s), parts {dict(t.parts_by_donor)}{failed}, "
                    f"in {time.monotonic() - started:.1f} s")
        served = [donor for donor, parts in t.parts_by_donor.items() if parts]
        return (t.metadata, [t.flat[: self.n], t.flat[self.n:]]), served

    def _through_node(self, rules: StateDownload) -> tuple[Optional[StateTuple], list[str]]:
        """Where no live peer can be dialled: the newest state their records announce, pushed by one of its holders
        to a reducer node and fetched from there (p2pdiloco.swarm.staterelay); the state and its holders, who
        vouch for its digest as its donors would."""
        nodes = fetch_reducers(self.dht, self.cfg.run_id)
        started = time.monotonic()
        until = min(rules.deadline, started + RELAY_WAIT)
        while nodes and time.monotonic() < until and not self._stopping():
            live = rules.live(self.live_others(), time.monotonic())  # the swarm may have moved on since the last try
            newer = [r for r in live if r.version >= rules.min_version]
            if not newer:
                break
            # each node for RELAY_PER_NODE seconds in turn: one that died or never gets the state is not the end
            key = max(newer, key=lambda r: r.rank).key
            node = nodes[int((time.monotonic() - started) // RELAY_PER_NODE) % len(nodes)]["peer"]
            want_state(self.dht, self.cfg.run_id, self.heartbeat.identity, key, node)
            loaded, _ = self._from_donors((key, [node]), until)
            if loaded is not None:
                return loaded, [r.peer for r in live if r.key == key]
            time.sleep(RELAY_RETRY)
        return None, []

    def _stopping(self) -> bool:
        return self.stop.is_set() or self.closed.is_set()

    def load_state(self, timeout: float) -> Optional[StateTuple]:
        future = self.averager.load_state_from_peers(wait=False, timeout=timeout)
        try:
            loaded = result_unless_closed(future, timeout, self._stopping)
        except Exception as e:  # a hostile or dying donor, our time up, or asked to leave: report, never crash
            with contextlib.suppress(InvalidStateError):
                future.cancel()
            logger.info(f"state download failed: {type(e).__name__}: {e}")
            return None
        return None if loaded is None else (loaded[0], list(loaded[1]))

    def publish_state(self, version: int, state_digest: str, sketch: list[float], merged_by: int = 0) -> None:
        """After every round and every change of Θ: donors are ranked by the same order peers reconcile by. Our
        island's `merging` is withdrawn only now, with the state it made: withdrawn as the round ended, it left a
        moment where our record showed neither the island nor its merge, and a peer that waited for it formed an
        island at the old version (a fork; seen on the H200 machine)."""
        if not self.cfg.client_mode:  # a client serves no state (hivemind refuses to rank it)
            self.averager.state_sharing_priority = sharing_priority(version, merged_by, state_digest)
        self.heartbeat.update(version=version, digest=state_digest, merged_by=merged_by, sketch=sketch, merging=-1)

    def shutdown(self) -> None:
        self.closed.set()  # before the averager goes: its pending step would never resolve
        if self.pusher is not None:
            self.pusher.stop()
        self.fetcher.close()
        if self.averager.is_alive():
            self.averager.shutdown()


def merging_announcer(control, heartbeat: Heartbeat | LaneBeat, version: int) -> Callable[[], None]:
    """Once our island's all-reduce has begun, say so in our record: a peer ready now cannot join it, and one that
    sees it waits for its end (protocol.round, `wait_for_island`) rather than form a second island at our version."""
    def announce() -> None:
        if control.began_allreduce and heartbeat.record.merging != version:
            heartbeat.update(merging=version)
    return announce


def cancel(control) -> None:
    """Cancel an averager step; a second cancel (or one after it finished) is a no-op, not an error."""
    with contextlib.suppress(InvalidStateError):
        control.cancel()
