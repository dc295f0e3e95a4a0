"""Decoupled DiLoCo on a simulated clock, driven by the very round protocol the real peers run.

Each learner trains through the spans its failure model leaves it (`sim.lifeline`) and, every H steps of work,
hands a contribution to a `protocol.round.Round`; this module is that round's driver, as `swarm.rounds` is for
hivemind: it answers the protocol's decisions (peer records, state downloads, island formation, all-reduce results)
from the simulated swarm, with rules made from a peer's configuration (`protocol.round.swarm_rules`). Islands form
like hivemind's matchmaking: the first learner to look opens one for its grace window, whoever looks before it
closes joins, and the all-reduce then takes the time its bytes need on the link (`sim.sizes`). An elastic learner's
stalls cost it time only. A restarting learner loses the work since its last local checkpoint; if it was exchanging
tensors, its island's round fails for every member (their work rides along to the next).

With `fragments` P > 1 (Streaming DiLoCo), each learner is P lanes: one per fragment, each a learner of its own to
the protocol (its own version, rounds, islands and records, as a peer's fragments are swarms of their own), on one
work clock and one failure model, due on a peer's stagger (`core.fragments.Stagger`, at most τ in flight), with a
P-th of the all-reduce's bytes, and each counting a P-th of the work it merges.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from p2pdiloco.core.fragments import Stagger, fragment_overlap
from p2pdiloco.core.state import lineage_rank
from p2pdiloco.protocol.outcomes import Contribution, RoundOutcome
from p2pdiloco.protocol.remote import Member, PeerRecord
from p2pdiloco.protocol.round import (Done, Download, FormIsland, IslandFailed, IslandReduced, NoIsland,
                                      RefreshPeers, Round, WaitForPeers, swarm_rules)
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.sim.baselines import SimResult
from p2pdiloco.sim.failures import Draws, learner_clocks, union_length
from p2pdiloco.sim.lifeline import Span, WorkClock, checkpoint_before, clip
from p2pdiloco.sim.params import SimParams
from p2pdiloco.sim.sizes import allreduce_seconds, join_seconds

_DELTA = torch.zeros(1)  # the protocol carries a pseudo-gradient; the simulator's content is irrelevant


@dataclass
class Learner:
    index: int
    step: float  # seconds per inner step
    work: WorkClock  # when it trains, under its failure model
    lane: int = 0  # its fragment (--fragments; 0 of 1 without): one of its learner's lanes, sharing `work`
    timing: RoundClock = field(default_factory=RoundClock)  # the EMAs a peer keeps about its rounds
    up: bool = True
    version: int = 0
    digest: str = "v0-init"
    last_members: list = field(default_factory=list)  # of the merge that made its state: forks reconcile by them
    anchor: float = 0.0  # start of the work not yet handed to a round
    pending: list = field(default_factory=list)  # (start, end) of work not yet merged, not in a round
    restored: list = field(default_factory=list)  # the work since its last contribution that a restart kept
    round: Optional[Round] = None
    in_round: list = field(default_factory=list)  # the work the round in flight carries
    due: bool = False  # H steps are done while a round was in flight: contribute when it settles
    due_since: float = math.inf  # since when (of a learner's waiting fragments, the longest overdue goes first)
    island: Optional["Island"] = None
    life: int = 0  # bumped on each death: events of an earlier life are ignored
    schedule: int = 0  # bumped when a fragment goes early: its contribution scheduled before is void
    poll: int = 0  # bumped on each look at the records scheduled: only the latest one counts
    name: str = ""

    def __post_init__(self):
        self.name = self.name or f"learner{self.index}"

    def seen(self) -> tuple[str, int, str, int, int]:
        """What its record says (name, version, digest, ready, merging): as a real peer's heartbeat, ready from its
        first look at the records until its round is over, merging while its island's all-reduce runs."""
        rnd = self.round
        ready = rnd.c.version if rnd is not None and rnd.phase not in ("new", "catch_up") else -1
        merging = rnd.c.version if self.island is not None and self.island.closed else -1
        return self.name, self.version, self.digest, ready, merging

    def record(self) -> PeerRecord:
        name, version, digest, ready, merging = self.seen()
        return PeerRecord(name, name, version, digest, ready, merging, merged_by=len(self.last_members))

    @property
    def rank(self) -> tuple[int, int, str]:
        return lineage_rank(self.version, len(self.last_members), self.digest)

    def work_in(self, intervals) -> float:
        return sum(self.work.work_at(b) - self.work.work_at(a) for a, b in intervals)

    def steps_in(self, intervals) -> int:
        return round(self.work_in(intervals) / self.step)


@dataclass
class Island:
    id: int
    lane: int = 0
    members: list = field(default_factory=list)
    closed: bool = False
    failed: bool = False


class DecoupledSim:
    mode = "decoupled"

    def __init__(self, p: SimParams, d: Draws):
        self.p, self.d = p, d
        self.rules = swarm_rules(p.swarm(), grace_floor=join_seconds(p), buffer_elements=0, poll=1.0,
                                 overlap_steps=fragment_overlap(p.inner_steps, p.fragments, p.fragments_in_flight))
        self.stagger = Stagger(p.fragments, p.inner_steps, p.fragments_in_flight)
        self.lane_sizes = dataclasses.replace(p, model_params=max(1, p.model_params // p.fragments))  # its bytes
        self.learners = [Learner(i, d.step_seconds[i], clock, lane=f, name=_name(i, f, p.fragments))
                         for i, clock in enumerate(learner_clocks(p, d)) for f in range(p.fragments)]
        self.events: list = []
        self.seq = itertools.count()
        self.island_ids = itertools.count(1)
        self.open_islands: dict[int, Island] = {}  # lane → its island open for members
        self.useful: list[tuple[float, float]] = []
        self.chip_seconds = 0.0
        self.commits = 0
        self.outcomes: dict[str, int] = {}
        self.merged: list[tuple[int, int]] = []  # per outer step: (learners merged, learners up)
        self.waiting: dict[str, Learner] = {}  # learners whose round waits on the records (quorum, newest peers)
        self.states: dict[tuple, set[str]] = {}  # (lane, version) → the states made at it (more than one: a fork)

    # ---- the event loop -----------------------------------------------------------------------------------
    def run(self) -> SimResult:
        for learner in self.learners:  # fragment i is first due after (i + 1)·H/P steps
            self._next_contribution(0.0, learner, done=learner.step * (self.p.inner_steps -
                                                                       self.stagger.first(learner.lane)))
            for span in learner.work.spans:
                if span.died:
                    self._push(span.end, "fail", learner, span)
        seen = self._seen()
        while self.events:
            t, _, kind, learner, arg = heapq.heappop(self.events)
            if t > self.p.horizon:
                break
            getattr(self, f"_on_{kind}")(t, learner, arg)
            now_seen = self._seen()  # what the records say, without building them (most of the run's time)
            if now_seen != seen:  # as a real peer sees a record change at its next poll
                self._wake(t)
                self._join_early(t)
            seen = now_seen
        return self._result()

    def _result(self) -> SimResult:
        failures = sum(len(f) for f in self.d.failures)
        merged = [m for m, _ in self.merged]
        share = [m / up for m, up in self.merged if up]
        not_committed = sum(n for kind, n in self.outcomes.items() if kind not in ("committed", "solo", "adopted"))
        return SimResult(self.mode, self.chip_seconds / (self.p.chips * self.p.horizon),
                         union_length(self.useful) / self.p.horizon, failures, self.commits,
                         details=dict(failure=self.p.learner_failure, fragments=self.p.fragments,
                                      outcomes=dict(sorted(self.outcomes.items())),
                                      forks=sum(len(d) - 1 for d in self.states.values()),
                                      rollbacks=not_committed,
                                      merged_per_step=sum(merged) / len(merged) if merged else 0.0,
                                      live_share_merged=sum(share) / len(share) if share else 0.0))

    def _push(self, t: float, kind: str, learner: Optional[Learner], arg) -> None:
        if math.isfinite(t):
            heapq.heappush(self.events, (t, next(self.seq), kind, learner, arg))

    def _next_contribution(self, t: float, learner: Learner, done: float = 0.0) -> None:
        """H steps of work after t, `done` seconds of them already done (restored from a checkpoint): its spans
        say when."""
        self._push(learner.work.wall_after(t, learner.step * self.p.inner_steps - done), "contribute", learner,
                   (learner.life, learner.schedule))

    # ---- learners -----------------------------------------------------------------------------------------
    def _on_contribute(self, t: float, learner: Learner, when: tuple[int, int]) -> None:
        if when != (learner.life, learner.schedule):
            return
        self._next_contribution(t, learner)
        if learner.round is not None or self._in_flight(learner.index) >= self.p.fragments_in_flight:
            # training goes on; the next contribution leaves once this round (or τ's: a slot) settles
            learner.due, learner.due_since = True, min(learner.due_since, t)
            return
        self._contribute(t, learner)

    def _join_early(self, t: float) -> None:
        """Fragments whose peers look for an island for them go along with half a round of steps or more
        (`Stagger.joins_early`), then are next due H steps on, as a peer's; P = 1 never does."""
        if self.p.fragments == 1:
            return
        looking = {x.lane for x in self.learners if x.up and x.seen()[3] >= 0}  # never x itself: it has no round
        for x in self.learners:
            if (x.lane in looking and x.up and x.round is None and not x.due
                    and self._in_flight(x.index) < self.p.fragments_in_flight
                    and self.stagger.joins_early(x.steps_in([(x.anchor, t)]))):
                x.schedule += 1
                self._next_contribution(t, x)
                self._contribute(t, x)

    def _lanes(self, index: int) -> list[Learner]:
        return self.learners[index * self.p.fragments:(index + 1) * self.p.fragments]

    def _in_flight(self, index: int) -> int:
        return sum(x.round is not None for x in self._lanes(index))

    def _release(self, t: float, index: int) -> None:
        """A round settled: the learner's fragments that came due meanwhile go, the longest overdue first, while
        fewer than τ are out (P = 1: its one contribution, as soon as its round settles)."""
        for x in sorted(self._lanes(index), key=lambda x: x.due_since):
            if x.due and x.up and x.round is None and self._in_flight(index) < self.p.fragments_in_flight:
                self._contribute(t, x)

    def _take_work(self, t: float, learner: Learner) -> int:
        """Hand the learner's unmerged work to a round: its steps."""
        learner.pending += learner.restored + [(learner.anchor, t)]
        learner.anchor, learner.due, learner.due_since, learner.restored = t, False, math.inf, []
        learner.in_round, learner.pending = learner.pending, []
        return learner.steps_in(learner.in_round)

    def _contribute(self, t: float, learner: Learner) -> None:
        steps = self._take_work(t, learner)
        learner.timing.step.update(learner.step)
        c = Contribution.of(_DELTA, tokens=max(1, steps), steps=max(1, steps), version=learner.version,
                            peer=learner.name, name=learner.name, digest=learner.digest,
                            merged_by=len(learner.last_members))
        learner.round = Round(self.rules, learner.name, c, learner.timing, t)
        self._decide(t, learner, learner.round.start(self._records(learner.lane), t))

    def _on_fail(self, t: float, learner: Learner, span: Span) -> None:
        """The process dies (restart model): it keeps what its newest local checkpoint holds."""
        cut = checkpoint_before(span, t, self.p.checkpoint_seconds)
        learner.pending = clip(learner.pending + learner.in_round, cut)
        learner.restored = clip(learner.restored + [(learner.anchor, t)], cut)  # its round's steps it keeps
        learner.up, learner.life = False, learner.life + 1
        learner.in_round, learner.round, learner.due, learner.due_since = [], None, False, math.inf
        self.waiting.pop(learner.name, None)
        island = learner.island
        if island is not None:
            if island.closed:
                island.failed = True  # it was exchanging tensors: the round fails for every member
            else:
                island.members.remove(learner)  # left during matchmaking: the others go on without it
            learner.island = None
        self._push(learner.work.next_start(t), "restart", learner, learner.life)

    def _on_restart(self, t: float, learner: Learner, life: int) -> None:
        if life != learner.life:
            return
        newest = max(self._swarm(learner.lane), key=lambda x: x.rank)
        learner.up, learner.version, learner.digest, learner.anchor = True, newest.version, newest.digest, t
        learner.last_members = list(newest.last_members)
        self._next_contribution(t, learner, done=learner.work_in(learner.restored))

    # ---- the protocol's decisions, answered from the simulated swarm ----------------------------------------
    def _decide(self, t: float, learner: Learner, decision) -> None:
        rnd = learner.round
        while True:
            if isinstance(decision, Done):
                return self._settle(t, learner, decision.outcome)
            if isinstance(decision, Download):
                decision = rnd.on_state(self._state_at_least(learner.lane, decision.min_version), t)
            elif isinstance(decision, (WaitForPeers, RefreshPeers)):
                decision = rnd.on_peers(self._records(learner.lane), t)
                if isinstance(decision, WaitForPeers):  # look again when a record changes, or when it stops waiting
                    self.waiting[learner.name] = learner
                    return self._look(decision.until, learner)
                self.waiting.pop(learner.name, None)
            elif isinstance(decision, FormIsland):
                return self._join_island(t, learner, decision)
            else:
                raise TypeError(f"unknown decision {decision!r}")

    def _look(self, t: float, learner: Learner) -> None:
        learner.poll += 1
        self._push(t, "poll", learner, (learner.round, learner.poll))

    def _wake(self, t: float) -> None:
        for learner in list(self.waiting.values()):
            self._look(t, learner)

    def _on_poll(self, t: float, learner: Learner, look) -> None:
        rnd, poll = look
        if learner.round is rnd and learner.poll == poll and learner.name in self.waiting:
            del self.waiting[learner.name]
            self._decide(t, learner, rnd.on_peers(self._records(learner.lane), t))

    def _swarm(self, lane: int) -> list[Learner]:
        """The learners of one fragment: a swarm of its own."""
        return self.learners[lane::self.p.fragments]

    def _records(self, lane: int) -> list[PeerRecord]:
        return [x.record() for x in self._swarm(lane) if x.up]

    def _seen(self) -> list[tuple]:
        return [x.seen() for x in self.learners if x.up]

    def _state_at_least(self, lane: int, version: int):
        newest = max(self._swarm(lane), key=lambda x: x.rank)
        if newest.version < version:
            return None
        return (dict(version=newest.version, digest=newest.digest, last_members=list(newest.last_members)), [])

    # ---- islands --------------------------------------------------------------------------------------------
    def _join_island(self, t: float, learner: Learner, form: FormIsland) -> None:
        island = self.open_islands.get(learner.lane)
        if island is None or island.closed:
            island = self.open_islands[learner.lane] = Island(next(self.island_ids), learner.lane)
            self._push(t + form.grace, "close", None, island)
        island.members.append(learner)
        learner.island = island

    def _on_close(self, t: float, _, island: Island) -> None:
        island.closed = True
        if self.open_islands.get(island.lane) is island:
            del self.open_islands[island.lane]
        if len(island.members) == 1:
            learner = island.members[0]
            learner.island = None
            return self._decide(t, learner, learner.round.on_island(NoIsland("no group formed"), t))
        if island.members:
            self._push(t + allreduce_seconds(self.lane_sizes, len(island.members)), "reduced", None, island)

    def _on_reduced(self, t: float, _, island: Island) -> None:
        members = [x for x in island.members if x.up and x.island is island]
        records = tuple(Member(peer=x.name, name=x.name, version=x.round.c.version, digest=x.round.c.digest,
                               tokens=x.round.c.tokens, steps=x.round.c.steps, budget=0.0) for x in members)
        if not island.failed and members:
            newest = max(records, key=lambda m: m.key)
            for x in members:  # the island's new global state; stale members download it from the others
                x.version, x.digest = newest.version + 1, f"v{newest.version + 1}-i{island.id}"
                x.last_members = [m.name for m in members]
            self.states.setdefault((island.lane, newest.version + 1), set()).add(f"v{newest.version + 1}-i{island.id}")
            self.commits += 1
            self.merged.append((len(members), self._up()))
        for x in members:
            x.island = None
            if island.failed:
                result = IslandFailed("a member died during the all-reduce")
            else:
                result = IslandReduced(verified=True, reason="ok", members=records,
                                       weights=tuple(1.0 / len(records) for _ in records), group_id=str(island.id),
                                       sync_seconds=allreduce_seconds(self.lane_sizes, len(records)), merged=_DELTA)
            self._decide(t, x, x.round.on_island(result, t))

    # ---- outcomes --------------------------------------------------------------------------------------------
    def _settle(self, t: float, learner: Learner, outcome: RoundOutcome) -> None:
        self.outcomes[outcome.kind] = self.outcomes.get(outcome.kind, 0) + 1
        learner.round = None
        if outcome.sync_seconds:
            learner.timing.sync.update(outcome.sync_seconds)
        learner.timing.quorum.update(outcome.quorum_seconds)
        if outcome.state_before is not None and not outcome.committed:  # adopted, then rolled back
            adopted = outcome.state_before[0]
            learner.version, learner.digest = adopted["version"], adopted["digest"]
            learner.last_members = list(adopted["last_members"])
        if outcome.committed:
            self._count_useful(learner, learner.in_round)
            if outcome.kind == "solo":
                learner.version, learner.last_members, self.commits = learner.version + 1, [learner.name], \
                    self.commits + 1
                self.merged.append((1, self._up()))
                learner.digest = f"v{learner.version}-{learner.name}"
                self.states.setdefault((learner.lane, learner.version), set()).add(learner.digest)
        else:
            learner.pending = learner.in_round + learner.pending  # rolled back: it rides along next time
        learner.in_round = []
        self._release(t, learner.index)


    def _count_useful(self, learner: Learner, intervals) -> None:
        """A fragment's merge holds a P-th of its steps' work (a peer counts a P-th of their seconds); uptime counts
        the time in which any fragment's work was merged."""
        for a, b in intervals:
            self.useful.extend(learner.work.pieces(a, b))
            self.chip_seconds += learner.work.chip_seconds(a, b) / self.p.fragments

    def _up(self) -> int:
        return sum(x.up for x in self.learners if x.lane == 0)


def simulate_decoupled(p: SimParams, d: Draws) -> SimResult:
    return DecoupledSim(p, d).run()


def _name(index: int, lane: int, fragments: int) -> str:
    return f"learner{index}" if fragments == 1 else f"learner{index}-f{lane}"
