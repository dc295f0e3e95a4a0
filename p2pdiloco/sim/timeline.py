"""Learners at unequal speeds, merging without a barrier, on a simulated clock: the decoupled rows of the parity
benchmark. Two cores cannot run four learners side by side, so each learner's inner steps cost it simulated
seconds (its `seconds_per_step`: 3 for a learner 3× slower) and one thread runs them in the order a real swarm
would. Each learner is a peer's own DiLoCo; its rounds are driven here, at simulated times, by the round protocol
(protocol.round) against the `Board` of p2pdiloco.sim.learners, which also makes every island's merge. Islands
close at their grace window's end (hivemind's matchmaking) and return `sync_seconds` later.

The order of events is fixed by the simulated clock alone, so a run is repeatable: an outcome is applied by the
learner's DiLoCo (`poll`, between two inner steps, as a peer does) at the simulated time the round ended.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import queue
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import Callable, Optional

from p2pdiloco.protocol.outcomes import Contribution, RoundOutcome
from p2pdiloco.protocol.round import (Done, Download, FormIsland, IslandReduced, NoIsland, RefreshPeers, Round,
                                      RoundRules, WaitForPeers)
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.sim.learners import Board, Entry, Sender
from p2pdiloco.training.diloco import DiLoCo


class Deferred:
    """A learner's merger (training.diloco.Merger) whose outcome the timeline decides: `merge`, in DiLoCo's round
    thread, hands the contribution over and waits for the answer."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()

    def merge(self, c: Contribution) -> RoundOutcome:
        answer: Future = Future()
        self.inbox.put((c, answer))
        return answer.result()


@dataclass
class Runner:
    name: str
    diloco: DiLoCo
    merger: Deferred
    sender: Sender
    seconds_per_step: float
    clock: RoundClock = field(default_factory=RoundClock)  # the round's EMAs, in simulated seconds
    steps_since: int = 0  # inner steps since its last contribution
    round: Optional[Round] = None
    answer: Optional[Future] = None
    waiting: bool = False


@dataclass
class Island:
    closes_at: float
    entries: list[Entry] = field(default_factory=list)
    runners: list[Runner] = field(default_factory=list)


class Timeline:
    def __init__(self, board: Board, rules: RoundRules, runners: list[Runner], h: int, sync_seconds: float):
        self.board, self.rules, self.runners, self.h, self.sync_seconds = board, rules, runners, h, sync_seconds
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.island: Optional[Island] = None
        self.outcomes: dict[str, int] = {}
        self.stale_merges = 0  # committed rounds whose contribution came from an older state than the newest member's
        self._seen_changes = -1

    def run(self, keep_training: Callable[[int], bool], on_tokens: Callable[[int], None] = lambda tokens: None) -> float:
        """Train while `keep_training(tokens trained so far)`, let the rounds in flight end, and return the
        simulated seconds it took. `on_tokens(tokens)` is called after every inner step."""
        for r in self.runners:
            self._push(r.seconds_per_step, "step", r, None)
        tokens = 0
        while self.events:
            t, _, kind, runner, payload = heapq.heappop(self.events)
            self.now = t
            if kind == "step":
                if not keep_training(tokens):
                    continue  # the budget is spent: no more steps, only the rounds in flight go on
                tokens += self._step(runner)
                on_tokens(tokens)
            else:
                getattr(self, f"_on_{kind}")(runner, payload)
            self._wake_waiters()
        return self.now

    def _push(self, t: float, kind: str, runner: Optional[Runner], payload) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, runner, payload))

    # ---- learners -------------------------------------------------------------------------------------------
    def _step(self, r: Runner) -> int:
        r.diloco.inner_step()
        r.clock.step.update(r.seconds_per_step)
        r.steps_since += 1
        self._push(self.now + r.seconds_per_step, "step", r, None)
        if r.round is None and r.steps_since >= self.h:
            self._contribute(r)
        return r.diloco.trainer.tokens_per_step

    def _contribute(self, r: Runner) -> None:
        r.diloco.contribute()
        c, r.answer = r.merger.inbox.get(timeout=60)
        r.steps_since = 0
        r.round = Round(self.rules, r.name, c, r.clock, self.now)
        self._decide(r, r.round.start(self.board.others(r.name), self.now))

    def _decide(self, r: Runner, decision) -> None:
        rnd = r.round
        while not isinstance(decision, Done):
            if isinstance(decision, Download):
                decision = rnd.on_state(self.board.download(decision.min_version), self.now)
            elif isinstance(decision, WaitForPeers):
                self.board.announce(r.name, ready=decision.ready_version)
                r.waiting = True
                self._push(decision.until, "timer", r, rnd)
                return
            elif isinstance(decision, RefreshPeers):
                decision = rnd.on_peers(self.board.others(r.name), self.now)
            elif isinstance(decision, FormIsland):
                return self._join(r, decision)
            else:
                raise TypeError(f"unknown decision {decision!r}")
        self._finish(r, decision.outcome)

    def _on_timer(self, r: Runner, rnd: Round) -> None:
        if r.round is rnd and r.waiting:
            r.waiting = False
            self._decide(r, rnd.on_timer(self.now))

    def _wake_waiters(self) -> None:
        """A record changed: every learner waiting on the records looks again, as a peer's next poll would."""
        while self._seen_changes != self.board.changes:
            self._seen_changes = self.board.changes
            for r in self.runners:
                if r.waiting:
                    r.waiting = False
                    self._decide(r, r.round.on_peers(self.board.others(r.name), self.now))

    # ---- islands -----------------------------------------------------------------------------------------
    def _join(self, r: Runner, form: FormIsland) -> None:
        if self.island is None:
            self.island = Island(self.now + form.grace)
            self._push(self.island.closes_at, "close", None, self.island)
        self.island.entries.append(r.sender.entry(r.round.c, form.budget))
        self.island.runners.append(r)

    def _on_close(self, _, island: Island) -> None:
        if self.island is island:
            self.island = None
        if len(island.runners) == 1:
            r = island.runners[0]
            return self._decide(r, r.round.on_island(NoIsland("no other learner joined"), self.now))
        for r in island.runners:  # closed to others now: a peer that sees it waits for its merge (wait_for_island)
            self.board.announce(r.name, merging=r.round.c.version)
        self._push(self.now + self.sync_seconds, "reduced", None, island)

    def _on_reduced(self, _, island: Island) -> None:
        result = self.board.reduce(island.entries)
        if isinstance(result, IslandReduced):
            result = dataclasses.replace(result, sync_seconds=self.sync_seconds)
        for r in island.runners:
            self._decide(r, r.round.on_island(r.sender.received(r.round.c, result), self.now))

    # ---- outcomes -----------------------------------------------------------------------------------------
    def _finish(self, r: Runner, outcome: RoundOutcome) -> None:
        self.board.announce(r.name, ready=-1)  # `merging` stays until its state is published, as a peer's does
        outcome = r.sender.alone(r.round.c, outcome)
        self.outcomes[outcome.kind] = self.outcomes.get(outcome.kind, 0) + 1
        self.stale_merges += bool(outcome.committed and outcome.stale)
        if outcome.sync_seconds:
            r.clock.sync.update(outcome.sync_seconds)
        r.clock.quorum.update(outcome.quorum_seconds)
        r.answer.set_result(outcome)
        wait_for([r.diloco.in_flight.future], timeout=60)
        r.diloco.poll()  # applied between two inner steps, at this simulated time
        r.round, r.answer = None, None
        self.board.publish(r.name, r.diloco.state)
        if r.steps_since >= self.h:
            self._contribute(r)
