"""One round's decisions, as a pure state machine: events in, decisions out, time passed in as `now`.

No hivemind, no clock, no threads: a driver performs each decision (download a state, wait for peers, form an
island) and reports what happened as the next event. The hivemind driver (p2pdiloco.swarm.rounds) runs it
against the real swarm; the simulator (p2pdiloco.sim) runs the same object on a simulated clock.

Decoupled mode (the default), no global barrier:
1. catch up first only if needed: a live peer holds a higher state at our version (a fork: everyone moves to
   the highest `lineage_rank`; also where it shows only while we wait for quorum) or is more than
   `max_staleness` versions ahead;
2. quorum: wait until K−1 other peers are looking for an island (K=1: no wait); with `wait_for_newest`, while
   peers on a newer state than ours train and none of them looks, wait for them too (up to 1.5 τ steps): an
   island without them would fork; with `wait_for_island` (the default), while an island merges from a state at
   least as new as ours without us (closed: its all-reduce has begun), wait for its end rather than make a second
   state at its version with whoever else came late; if it merged, wait for its members as `wait_for_newest` does
   and join their next island a version behind, or, if they do not look in time, take their state and roll back
   (our Δ rides along with our next contribution);
3. grace window (Eq. 3, from measured EMAs): how long our matchmaking stays open for more members;
4. the island's exact sum; a complete, checked, finite result commits, anything else rolls back;
5. members on the group's newest state apply the merge; stale members download that state afterwards.
A peer alone in the swarm (K=1) applies its own update at once. A peer that finds no island while others are
alive (or an island that merged only itself) rolls back instead: its Δ rides along with its next contribution. Applying it alone would fork Θ, and the
fork's update would be dropped when the forks reconcile.

Sync mode, the baseline: the same, after a barrier where everyone waits for everyone at our version.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Sequence, Union

import torch

from p2pdiloco.core.exact import all_finite
from p2pdiloco.core.outer import Segment, rda_combine
from p2pdiloco.core.state import lineage_rank, merged_by
from p2pdiloco.protocol.outcomes import (Adopted, Committed, Contribution, Left, RolledBack, RoundOutcome, Solo,
                                         StateTuple, newest_member)
from p2pdiloco.protocol.remote import Member, PeerRecord
from p2pdiloco.protocol.timing import GracePolicy, RoundClock, allreduce_wire_bytes
from p2pdiloco.runtime.paging import LetGo, hold


@dataclass(frozen=True, kw_only=True)
class RoundRules:
    """What every round of this peer follows; built once from the configuration and the averager's limits."""

    mode: str = "decoupled"
    quorum: int = 1  # K, this peer included
    max_staleness: int = 2
    sync_wait: float = 60.0  # sync mode: the barrier's longest wait
    overlap_steps: int = 50  # τ of Eq. 3
    grace: GracePolicy = field(default_factory=GracePolicy)
    request_timeout: float = 2.0  # hivemind's matchmaking request timeout
    allreduce_cap: float = 60.0  # the outer bound on one all-reduce
    buffer_elements: int = 0  # what one all-reduce moves per member
    max_island: int = 16
    declared_bytes_per_s: float = 12.5e6  # the link speed assumed until a round is measured
    poll: float = 0.25  # how often a driver looks at peer records while waiting
    rda_segments: tuple[Segment, ...] = ()  # RDA on: the merge is recombined from directions and norms
    wait_for_newest: bool = False  # behind peers that are not looking: wait for them rather than fork (decoupled)
    wait_for_island: bool = True  # an island merging from our state without us: wait, adopt its merge (decoupled)


def swarm_rules(cfg, overlap_steps: int, grace_floor: float, grace_cap: float = GracePolicy.cap,
                **limits) -> RoundRules:
    """The rules a peer of configuration `cfg` (a `config.SwarmConfig`) follows: the one place its settings become
    rules, for the hivemind driver and the simulator alike. `grace_floor`: the driver's shortest matchmaking;
    `limits`: the driver's timeouts and sizes (RoundRules' other fields)."""
    return RoundRules(mode=cfg.mode, quorum=cfg.quorum, max_staleness=cfg.max_staleness, sync_wait=cfg.sync_wait,
                      wait_for_newest=cfg.wait_for_newest, wait_for_island=cfg.wait_for_island,
                      overlap_steps=overlap_steps, max_island=cfg.max_island,
                      grace=GracePolicy(gamma=cfg.grace_gamma, floor=grace_floor, cap=grace_cap), **limits)


# ---- decisions: what the driver is asked to do next ------------------------------------------------------
@dataclass(frozen=True)
class Download:
    """Fetch a validated global state of at least `min_version`; report it with `on_state` (None: failed)."""

    min_version: int
    why: str


@dataclass(frozen=True)
class WaitForPeers:
    """Announce `ready_version` and report peer records with `on_peers` every `poll` s, or `on_timer` at `until`."""

    ready_version: int
    until: float
    poll: float


@dataclass(frozen=True)
class FormIsland:
    """Look for an island for `grace` s (the grace window), give up matchmaking after `find_timeout` s, and
    the whole round after `result_timeout` s; ask the group for an all-reduce deadline of `budget` s."""

    grace: float
    find_timeout: float
    result_timeout: float
    budget: float


@dataclass(frozen=True)
class RefreshPeers:
    """Report the live peer records now (`on_peers`): no island formed, are we alone?"""


@dataclass(frozen=True)
class Done:
    outcome: RoundOutcome


Decision = Union[Download, WaitForPeers, FormIsland, RefreshPeers, Done]


# ---- what an island attempt returned ----------------------------------------------------------------------
@dataclass(frozen=True)
class NoIsland:
    """Matchmaking ended without a group."""

    reason: str = "no island formed"


@dataclass(frozen=True)
class IslandFailed:
    """A group formed, but the all-reduce raised or timed out."""

    reason: str


@dataclass(frozen=True)
class IslandReduced:
    """The all-reduce returned. `merged` is the decoded Σ wᵢΔᵢ when `verified` (directions, with RDA)."""

    verified: bool
    reason: str
    members: tuple[Member, ...]  # accepted members, in group order
    weights: tuple[float, ...]  # theirs, summing to 1
    group_id: str = ""
    sync_seconds: float = 0.0
    sync_ended: float = 0.0  # Unix time the all-reduce returned (the driver's clock; the protocol keeps none)
    codec_cpu_seconds: float = 0.0  # the codec thread's CPU in this round (swarm.codes.codec_cpu_seconds)
    deadline: float = 0.0
    merged: Optional[torch.Tensor] = None
    let_go: LetGo = field(default=hold, repr=False, compare=False)  # a pass over `merged` calls it
    excluded: dict = field(default_factory=dict)  # peer (or index) → why its record was rejected
    codec_scales: Optional[torch.Tensor] = None  # the block scales the group agreed on (error feedback)
    bounded: dict = field(default_factory=dict)  # peer → what of its claims was capped (p2pdiloco.protocol.island)
    blamed: frozenset = frozenset()  # members whose part or sum failed this round (we blame them for a while)
    tokens: Optional[int] = None  # what the merge adds to Θ's token count (the plan's); None: the members' claims


IslandResult = Union[NoIsland, IslandFailed, IslandReduced]


class Phase(str, Enum):
    """Where a round is; each event it accepts belongs to one phase."""

    NEW = "new"
    CATCH_UP = "catch_up"  # behind, or on a fork: downloading the newest state before contributing
    QUORUM = "quorum"  # waiting for enough peers to be ready
    ISLAND = "island"  # the island is forming or merging
    CONFIRM_ALONE = "confirm_alone"  # no island (quorum 1): checking that nobody else is alive before a solo merge
    ADOPT = "adopt"  # an island merged from our state without us: taking its result
    STALE_FETCH = "stale_fetch"  # merged on a newer state than ours: fetching it
    DONE = "done"


class ProtocolError(RuntimeError):
    """A driver reported an event the round is not waiting for (a bug in the driver, never remote input)."""


class Round:
    """One contribution's way through a round. Call `start`, then feed each decision's result back."""

    def __init__(self, rules: RoundRules, me: str, contribution: Contribution, clock: RoundClock, now: float):
        self.rules, self.me, self.c, self.clock = rules, me, contribution, clock
        self.started = now
        self.phase = Phase.NEW
        self.state_before: Optional[StateTuple] = None
        self.quorum_started = self.quorum_seconds = self.other_wait = 0.0  # other: not for quorum (below)
        self.waited_for_island = False
        self.catch_up_tried = False
        self.others: list[PeerRecord] = []
        self.island: Optional[FormIsland] = None
        self.no_island_reason = ""
        self.reduced: Optional[IslandReduced] = None

    # ---- events -----------------------------------------------------------------------------------------
    def start(self, peers: Sequence[PeerRecord], now: float) -> Decision:
        self._expect(Phase.NEW)
        return self._catch_up(self._others(peers)) or self._wait_for_quorum(now)

    def _catch_up(self, others: list[PeerRecord], forks_only: bool = False) -> Optional[Download]:
        """Download first where a live peer holds a higher state at our version (a fork) or is too far ahead;
        once a round: a download that failed is not retried at every poll."""
        if not others or self.catch_up_tried:
            return None
        best = max(others, key=lambda r: r.rank)
        behind_limit = 0 if self.rules.mode == "sync" else self.rules.max_staleness
        fork = best.version == self.c.version and best.rank > lineage_rank(self.c.version, self.c.merged_by,
                                                                          self.c.digest)
        if not fork and (forks_only or best.version <= self.c.version + behind_limit):
            return None
        self.phase, self.catch_up_tried = Phase.CATCH_UP, True
        return Download(best.version, "fork" if fork else "behind")

    def on_state(self, state: Optional[StateTuple], now: float) -> Decision:
        if self.phase == Phase.ADOPT:
            if state is None:
                return self._done(self._rolled_back_type, now, "rolled back: an island merged without us, and "
                                  "its state did not download")
            self.state_before = state
            return self._done(Adopted, now, f"rolled back: an island merged from v{self.c.version} without us; "
                              f"took its state v{int(state[0]['version'])}")
        if self.phase == Phase.CATCH_UP:
            if state is not None:
                self.state_before = state
                self.c = dataclasses.replace(self.c, version=int(state[0]["version"]),
                                             digest=str(state[0]["digest"]), merged_by=merged_by(state[0]))
            return self._wait_for_quorum(now)
        self._expect(Phase.STALE_FETCH)
        return self._done(Committed, now, self.reduced.reason, state=state, stale=True)

    def on_peers(self, peers: Sequence[PeerRecord], now: float) -> Decision:
        if self.phase == Phase.CONFIRM_ALONE:
            if self._others(peers):
                return self._done(self._rolled_back_type, now, f"all-reduce failed: {self.no_island_reason}")
            return self._solo(now)  # everyone else left while we looked
        self._expect(Phase.QUORUM)
        self.others = self._others(peers)
        # a state that outranks ours at our version may show only now: the records at our start can be a heartbeat
        # old, and an island that merged our version elsewhere a moment before ours would otherwise fork on for
        # another round (a peer ahead is the quorum's business here: the sync barrier counts it as arrived)
        caught_up = self._catch_up(self.others, forks_only=True)
        if caught_up is not None:
            return caught_up
        if not self._quorum_reached(now):
            return self._waiting(now)
        if self.waited_for_island and self._newest_not_ready():
            self.phase = Phase.ADOPT  # the island we waited for merged: an island of ours now would fork its state
            return Download(max(r.version for r in self.others), "an island merged without us")
        # the waits for peers on a newer state or an island in flight are not the quorum's: Eq. 3 would shut our
        # grace window for them
        self.quorum_seconds = now - self.quorum_started - self.other_wait
        if not self.others and self.rules.quorum <= 1:
            return self._solo(now)  # alone in the swarm: K=1 applies its own update
        return self._form_island()

    def on_timer(self, now: float) -> Decision:
        return self.on_peers(self.others, now)

    def on_island(self, result: IslandResult, now: float) -> Decision:
        self._expect(Phase.ISLAND)
        if isinstance(result, IslandReduced) and result.verified and len(result.members) == 1:
            # every other member was left out (records that did not parse, blame): merging alone would fork Θ
            # while others are alive, exactly as if no island had formed
            why = "; ".join(sorted(set(result.excluded.values())))[:200]
            result = NoIsland(f"the island merged only us (the others left out: {why or 'none named'})")
        if isinstance(result, NoIsland):
            if self.rules.quorum <= 1:
                self.phase, self.no_island_reason = Phase.CONFIRM_ALONE, result.reason
                return RefreshPeers()
            return self._done(self._rolled_back_type, now, f"all-reduce failed: {result.reason}")
        if isinstance(result, IslandFailed):
            return self._done(self._rolled_back_type, now, f"all-reduce failed: {result.reason}")
        return self._on_reduced(result, now)

    def on_leaving(self, now: float, reason: str = "leaving") -> Decision:
        return self._done(Left, now, reason)

    # ---- decisions ----------------------------------------------------------------------------------------
    def _wait_for_quorum(self, now: float) -> Decision:
        self.phase, self.quorum_started = Phase.QUORUM, now
        return self._waiting(now)

    def _waiting(self, now: float) -> WaitForPeers:
        until = self._give_up_at()
        if self.rules.mode != "sync" and self._newest_not_ready() and now < self._newest_due() < until:
            until = self._newest_due()  # a driver that looks only when records change looks again then
        return WaitForPeers(self.c.version, until, self.rules.poll)

    def _give_up_at(self) -> float:
        return (self.started + self.rules.sync_wait if self.rules.mode == "sync"
                else self.quorum_started + self.rules.grace.cap)

    def _quorum_reached(self, now: float) -> bool:
        if now >= self._give_up_at():
            return True
        if self.rules.mode == "sync":  # everyone waits for everyone at our version
            ahead = [r for r in self.others if r.version > self.c.version]
            expected = [r for r in self.others if r.version == self.c.version]
            self.others = expected + ahead
            return bool(ahead) or all(r.ready == self.c.version for r in expected)
        if self._island_in_flight():
            self.waited_for_island, self.other_wait = True, now - self.quorum_started
            return False  # until its end shows in the records, or we give up (above)
        if self._newest_not_ready() and now < self._newest_due():
            self.other_wait = now - self.quorum_started
            return False
        return sum(r.ready >= 0 for r in self.others) >= self.rules.quorum - 1  # any version: stale are welcome

    def _newest_not_ready(self) -> bool:
        """Live peers hold a newer state than ours and none of them is looking for an island: one we formed now
        could hold no member on the newest state, and its merge would make a second state at a version the swarm
        already has (a fork: one lineage's merge then rides along as a longer Δ). Waiting for them instead, we
        join their next island one version behind (our weight discounted where the swarm's --stale-factor says)."""
        ahead = [r for r in self.others if r.version > self.c.version]
        return bool(ahead) and not any(r.ready >= 0 for r in ahead)

    def _island_in_flight(self) -> bool:
        """Live peers merge from a state at least as new as ours in an island closed to us. Any island we formed
        meanwhile would make a second state at a version it makes too (a fork), so we wait for its end. An island
        has two members at least (a stale one merges from an older state): one record alone saying so (a liar's)
        cannot hold our rounds up."""
        merging = [r.merging for r in self.others if r.merging >= 0]
        return self.rules.wait_for_island and len(merging) >= 2 and max(merging) >= self.c.version

    def _newest_due(self) -> float:
        """How long we wait for them: until they are due to contribute again, τ inner steps after their last round
        at most, with half as much again for slower peers (from our measured step time; no wait before we measured
        one). A peer that never comes costs one such wait per round."""
        if not (self.rules.wait_for_newest or self.waited_for_island):
            return self.quorum_started
        due = 1.5 * self.rules.overlap_steps * self.clock.step.get()
        return self.quorum_started + min(self.rules.grace.cap, due)

    def _form_island(self) -> FormIsland:
        rules = self.rules
        grace = self.clock.grace(rules.overlap_steps, rules.grace)
        budget = self.clock.allreduce_budget(allreduce_wire_bytes(rules.buffer_elements, rules.max_island),
                                             rules.declared_bytes_per_s)
        find_timeout = grace + 2 * rules.request_timeout + 2.0
        self.phase = Phase.ISLAND
        self.island = FormIsland(grace, find_timeout, find_timeout + rules.allreduce_cap + 5.0, budget)
        return self.island

    def _on_reduced(self, r: IslandReduced, now: float) -> Decision:
        self.reduced = r
        if not r.verified or r.merged is None:
            return self._done(self._rolled_back_type, now, f"round discarded: {r.reason}")
        if not r.members or len(r.weights) != len(r.members):
            return self._done(self._rolled_back_type, now, "round discarded: no accepted member")
        merged = r.merged
        if self.rules.rda_segments:
            try:
                merged = rda_combine(merged, [list(m.norms) for m in r.members], list(r.weights),
                                     list(self.rules.rda_segments))
            except (ValueError, IndexError, RuntimeError) as e:
                return self._done(self._rolled_back_type, now, f"round discarded: malformed RDA norms ({e})")
        if not all_finite(merged, let_go=r.let_go):
            return self._done(self._rolled_back_type, now, "round discarded: merged update is not finite")
        self.reduced = dataclasses.replace(r, merged=merged, reason="ok")
        wire = allreduce_wire_bytes(self.rules.buffer_elements, len(r.members))
        if wire and r.sync_seconds > 0:
            self.clock.throughput.update(wire / r.sync_seconds)
        newest = newest_member(list(r.members))
        if newest.key != (self.c.version, self.c.digest):
            # we contributed from an older state: the newest members applied the merge; fetch theirs
            self.phase = Phase.STALE_FETCH
            return Download(newest.version + 1, "stale contribution")
        return self._done(Committed, now, "ok")

    # ---- outcomes -------------------------------------------------------------------------------------------
    @property
    def _rolled_back_type(self) -> type[RoundOutcome]:
        return Adopted if self.state_before is not None else RolledBack

    def _solo(self, now: float) -> Done:
        self.phase = Phase.DONE
        return Done(Solo.own(self.c, **self._common(now)))  # the driver makes `merged` (outcomes.Solo)

    def _done(self, kind: type[RoundOutcome], now: float, reason: str, **extra) -> Done:
        self.phase = Phase.DONE
        fields = self._common(now)
        r = self.reduced
        if r is not None and kind is Committed:
            counted = sum(m.tokens for m in r.members) if r.tokens is None else r.tokens
            fields.update(merged=r.merged, let_go=r.let_go, members=list(r.members), weights=list(r.weights),
                          merged_tokens=counted,
                          group_id=r.group_id,
                          sync_seconds=r.sync_seconds, sync_ended=r.sync_ended, deadline_seconds=r.deadline,
                          excluded=dict(r.excluded),
                          codec_cpu_seconds=r.codec_cpu_seconds,
                          bounded=dict(r.bounded), allreduce_bytes_model=allreduce_wire_bytes(self.rules.buffer_elements, len(r.members)))
        elif r is not None:
            fields.update(group_id=r.group_id, sync_seconds=r.sync_seconds, sync_ended=r.sync_ended,
                          deadline_seconds=r.deadline,
                          codec_cpu_seconds=r.codec_cpu_seconds,
                          excluded=dict(r.excluded), bounded=dict(r.bounded))
        return Done(kind(reason=reason, **fields, **extra))

    def _common(self, now: float) -> dict:
        return dict(seconds=now - self.started, quorum_seconds=self.quorum_seconds, state_before=self.state_before,
                    grace_seconds=self.island.grace if self.island else 0.0, waited_for_island=self.waited_for_island)

    # ---- helpers --------------------------------------------------------------------------------------------
    def _others(self, peers: Sequence[PeerRecord]) -> list[PeerRecord]:
        return [r for r in peers if r.peer != self.me]

    def _expect(self, phase: "Phase") -> None:
        if self.phase != phase:
            raise ProtocolError(f"round is in phase {self.phase.value!r}, not {phase.value!r}")


def state_may_come(records: Sequence[PeerRecord], min_version: int) -> bool:
    """Whether a state of `min_version` or later can still be downloaded: a live peer that can serve (not in client
    mode: nobody can dial it) holds one, or is in an island's all-reduce that may make one (its record withdraws
    `merging` only when it publishes the state it made). Where neither holds, those that had it have left, and
    waiting for it cannot end but in a timeout."""
    return any(not r.client_mode and (r.version >= min_version or 0 <= r.merging and r.merging + 1 >= min_version)
               for r in records)
