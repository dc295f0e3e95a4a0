"""M learners in one process, each a whole peer's DiLoCo (training.diloco: its own θ, Θ, AdamW, data and error
feedback), merged in islands by the round protocol (protocol.round) and the island arithmetic (protocol.merge)
that the hivemind driver runs. This is a third driver of the same protocol, with no network: records live on a
`Board` instead of the DHT, and an island's members meet in one `OpenIsland` instead of hivemind's matchmaking.
Nothing of DiLoCo is written again here: the parity benchmark (scripts/bench/bench_parity.py) measures the code
a peer runs.

What stands in for the network, and what it keeps of the real thing:
- records: a learner's version and digest are published after each outcome is applied (as `publish_state`),
  `ready` while its round waits for peers, as a heartbeat does;
- an island closes once every learner that is ready has joined it, or its grace window ends; its result is
  `protocol.merge.merged_in_one_place` over the members' compensated contributions, on the plan
  `protocol.island.plan_island` makes from their records: the bits the averager's streamed sums give;
- error feedback: compensate before the record, record what the codes carried after, `alone` for a solo round,
  as `swarm.rounds.SwarmMerger` does.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.core import codec
from p2pdiloco.core.outer import Segment, rda_directions
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.island import Bounds, plan_island
from p2pdiloco.protocol.merge import BodyStatistics, merged_in_one_place, wire_format
from p2pdiloco.protocol.outcomes import Contribution, RoundOutcome, Solo, StateTuple
from p2pdiloco.protocol.remote import Island, Member, PeerRecord
from p2pdiloco.protocol.round import (Done, Download, FormIsland, IslandReduced, NoIsland, RefreshPeers, Round,
                                      RoundRules, WaitForPeers)
from p2pdiloco.protocol.timing import RoundClock

Clock = Callable[[], float]


@dataclass(frozen=True)
class Wire:
    """How the learners' pseudo-gradients travel and are merged: one swarm's settings."""

    bits: int = codec.BITS["none"]
    topk: Optional[float] = None
    error_feedback: bool = False
    feedback_decay: float = 1.0  # error feedback carries its residual times this (SparseLoCo's β)
    weighting: str = "tokens2"
    bounds: Bounds = field(default_factory=lambda: Bounds.of(OuterConfig()))  # a peer's, by default
    rda_segments: tuple[Segment, ...] = ()  # a peer's --rda: these tensors merged as directions and norms

    def feedback(self) -> Optional[codec.ErrorFeedback]:
        """A learner's own error feedback, where this wire has it."""
        return codec.ErrorFeedback(decay=self.feedback_decay) if self.error_feedback else None

    @classmethod
    def named(cls, name: str, **kwargs) -> "Wire":
        """fp32 (20-bit codes, the swarm's `--compression none`), int8, int4, int2, or topk2 (top 2 % of each
        block on int2 codes, error feedback decayed by 0.95: peers/slow-uplink.toml's wire); error feedback on where
        a peer has it by default (int4 and narrower, top-k)."""
        if name == "topk2":
            return cls(bits=codec.BITS["int2"], topk=0.02, error_feedback=True, feedback_decay=0.95, **kwargs)
        bits = codec.BITS["none" if name == "fp32" else name]
        return cls(bits=bits, error_feedback=bits <= 4, **kwargs)


@dataclass
class Entry:
    """One member's part in an island: its record and what it sends (its compensated Δ)."""

    member: Member
    body: torch.Tensor
    result: Optional[IslandReduced] = None


@dataclass
class OpenIsland:
    closes_at: float
    entries: list[Entry] = field(default_factory=list)
    closed: bool = False


class Board:
    """The learners' shared view: their records, their global states (the donors of downloads), the island
    being formed. Thread-safe: each learner's round runs in its DiLoCo's background thread."""

    def __init__(self, wire: Wire, n_params: int, clock: Clock = time.monotonic,
                 group_order: Optional[Callable[[str], object]] = None):
        """`group_order`: sorts an island's members by peer (default: the order they joined in). Members
        weigh each other in their group's order, and float sums of weights differ in the last bit between
        orders: hivemind's leader picks the order of a real group."""
        self.wire, self.n_params, self.clock, self.group_order = wire, n_params, clock, group_order
        self.records: dict[str, PeerRecord] = {}
        self.states: dict[str, GlobalState] = {}
        self.changed = threading.Condition()
        self.island: Optional[OpenIsland] = None
        self.islands = itertools.count(1)
        self.changes = 0  # bumped whenever a record changes: a driver on a simulated clock wakes its waiters

    def publish(self, name: str, state: GlobalState) -> None:
        with self.changed:
            self.states[name] = state
            old = self.records.get(name) or PeerRecord(name, name, 0, "")
            self.records[name] = dataclasses.replace(old, version=state.version, digest=state.digest,
                                                     merged_by=len(state.last_members), merging=-1)
            self.changes += 1
            self.changed.notify_all()

    def announce(self, name: str, **fields) -> None:
        """`ready` or `merging`, as a heartbeat announces them."""
        with self.changed:
            changed = dataclasses.replace(self.records[name], **fields)
            if changed != self.records[name]:
                self.records[name] = changed
                self.changes += 1
            self.changed.notify_all()

    def others(self, name: str) -> list[PeerRecord]:
        with self.changed:
            return [r for peer, r in self.records.items() if peer != name]

    def newest(self) -> GlobalState:
        with self.changed:
            return max(self.states.values(), key=lambda s: s.rank)

    def download(self, min_version: int) -> Optional[StateTuple]:
        """The newest global state, as a joiner or a stale member downloads it (None: none is new enough)."""
        with self.changed:
            if not self.states:
                return None
        newest = self.newest()
        if newest.version < min_version:
            return None
        return newest.snapshot()

    # ---- islands ------------------------------------------------------------------------------------------
    def join(self, entry: Entry, form: FormIsland) -> IslandReduced | NoIsland:
        """Join the island being formed (open one for our grace window if none is), and wait for its result."""
        with self.changed:
            island = self.island
            if island is None or island.closed:
                island = self.island = OpenIsland(self.clock() + form.grace)
            island.entries.append(entry)
            self.changed.notify_all()
            while not island.closed:
                if self._complete(island) or self.clock() >= island.closes_at:
                    self._close(island)
                    break
                self.changed.wait(timeout=max(0.001, min(0.05, island.closes_at - self.clock())))
            return entry.result if entry.result is not None else NoIsland("no other learner joined")

    def _complete(self, island: OpenIsland) -> bool:
        """Every learner looking for an island is in this one: nobody else could join it."""
        looking = {peer for peer, r in self.records.items() if r.ready >= 0}
        return looking <= {e.member.peer for e in island.entries}

    def _close(self, island: OpenIsland) -> None:
        island.closed = True
        if self.island is island:
            self.island = None
        if len(island.entries) > 1:
            reduced = self.reduce(island.entries)
            for e in island.entries:
                e.result = reduced
        self.changed.notify_all()

    def reduce(self, entries: list[Entry]) -> IslandReduced:
        """The island's result for every member: the plan from their records, the merge from their codes."""
        if self.group_order is not None:
            entries = sorted(entries, key=lambda e: self.group_order(e.member.peer))
        members = tuple(e.member for e in entries)
        wire = self.wire
        plan = plan_island(Island(members, tuple("" for _ in members)), wire.weighting, 60.0, self.n_params,
                           wire.bounds)
        if plan.weights is None:
            return IslandReduced(False, plan.reason, members, ())
        fmt = wire_format(wire.bits, wire.topk, len(plan.included))
        merged, scales = merged_in_one_place([e.body for e in entries], members, plan, wire.bits, fmt)
        return IslandReduced(True, "ok", members, tuple(plan.weights), group_id=f"island{next(self.islands)}",
                             tokens=plan.tokens,
                             merged=merged, codec_scales=scales,
                             bounded={members[i].peer: why for i, why in plan.bounded.items()})


class Sender:
    """What a learner does around an island, as `swarm.rounds.SwarmMerger` does: compensate Δ with error
    feedback before its record is made, record what its codes carried after, and merge what its wire would have
    carried when alone."""

    def __init__(self, name: str, wire: Wire, feedback: Optional[codec.ErrorFeedback]):
        self.name, self.wire, self.feedback = name, wire, feedback

    def sent(self, c: Contribution) -> tuple[torch.Tensor, list[float]]:
        """What goes on the wire before error feedback: Δ, or under RDA its directions, and their norms."""
        if self.wire.rda_segments:
            return rda_directions(c.delta, self.wire.rda_segments)
        return c.delta.clone(), []

    def entry(self, c: Contribution, budget: float) -> Entry:
        body, norms = self.sent(c)
        if self.feedback is not None:
            self.feedback.compensate_(body)
        statistics = BodyStatistics.of(body, wire_format(self.wire.bits, self.wire.topk, 1))
        member = Member(peer=self.name, name=self.name, version=c.version, digest=c.digest, tokens=c.tokens,
                        steps=c.steps, budget=budget, maxabs=statistics.statistic.numpy().tobytes(),
                        block_norms=statistics.norms.numpy().tobytes(), norms=tuple(norms))
        return Entry(member, body)

    def received(self, c: Contribution, result: IslandReduced | NoIsland):
        """The island's result as this member takes it: its own copy of the merge, error feedback recorded."""
        if not (isinstance(result, IslandReduced) and result.verified):
            return result
        weight = next((w for m, w in zip(result.members, result.weights) if m.peer == self.name), 0.0)
        if self.feedback is not None and weight > 0:
            fmt = wire_format(self.wire.bits, self.wire.topk, sum(w > 0 for w in result.weights))
            self.feedback.record_encoded(self.sent(c)[0], weight, result.codec_scales, self.wire.bits, fmt)
        return dataclasses.replace(result, merged=result.merged.clone())  # each member's own, as over a wire

    def alone(self, c: Contribution, outcome: RoundOutcome) -> RoundOutcome:
        if not isinstance(outcome, Solo):
            return outcome
        if self.feedback is None or self.wire.rda_segments:  # alone, a peer under RDA merges Δ itself
            return dataclasses.replace(outcome, merged=c.delta.clone())
        merged = self.feedback.alone(c.delta, self.wire.bits, wire_format(self.wire.bits, self.wire.topk, 1))
        return dataclasses.replace(outcome, merged=merged)


class IslandMerger:
    """A learner's merger (training.diloco.Merger) on the real clock: drives its `Round` against the board from
    DiLoCo's round thread, as swarm.rounds does against the DHT and the averager."""

    def __init__(self, board: Board, name: str, rules: RoundRules, feedback: Optional[codec.ErrorFeedback],
                 clock: RoundClock):
        self.board, self.name, self.rules, self.clock = board, name, rules, clock
        self.sender = Sender(name, board.wire, feedback)

    def merge(self, c: Contribution) -> RoundOutcome:
        now = self.board.clock
        rnd = Round(self.rules, self.name, c, self.clock, now())
        decision = rnd.start(self.board.others(self.name), now())
        try:
            while not isinstance(decision, Done):
                decision = self._do(rnd, decision)
        finally:
            self.board.announce(self.name, ready=-1)
        return self.sender.alone(c, decision.outcome)

    def _do(self, rnd: Round, decision):
        now = self.board.clock
        if isinstance(decision, Download):
            return rnd.on_state(self.board.download(decision.min_version), now())
        if isinstance(decision, WaitForPeers):
            self.board.announce(self.name, ready=decision.ready_version)
            return self._wait(rnd, decision)
        if isinstance(decision, RefreshPeers):
            return rnd.on_peers(self.board.others(self.name), now())
        if isinstance(decision, FormIsland):
            result = self.board.join(self.sender.entry(rnd.c, decision.budget), decision)
            return rnd.on_island(self.sender.received(rnd.c, result), now())
        raise TypeError(f"unknown decision {decision!r}")

    def _wait(self, rnd: Round, waiting: WaitForPeers):
        while True:
            decision = rnd.on_peers(self.board.others(self.name), self.board.clock())
            if not isinstance(decision, WaitForPeers):
                return decision
            with self.board.changed:
                self.board.changed.wait(timeout=max(0.001, min(decision.poll, decision.until - self.board.clock())))
