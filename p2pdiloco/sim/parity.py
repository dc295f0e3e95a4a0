"""Data-parallel training against DiLoCo at equal tokens, in one process: the rows of the parity benchmark
(scripts/bench/bench_parity.py). Every row trains the same model from the same initial weights, on the same
data, with the same inner hyper-parameters, and is measured on the same validation windows in bits per byte:

- `data_parallel`: AdamW at every step over M× the batch (one process: the same mathematics as M ranks
  all-reducing their gradients);
- `diloco`: M learners (p2pdiloco.sim.learners: each a peer's own DiLoCo), merging every H steps in synchronous
  rounds on a given wire;
- a learner alone is `diloco` with M = 1: its rounds are solo (K = 1), as a peer alone in a swarm;
- `decoupled`: M learners at unequal speeds (one 3× slower by default) on a simulated clock, merging without a
  barrier by a peer's default round rules (p2pdiloco.sim.timeline), so contributions arrive stale.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from p2pdiloco.config import InnerConfig, OuterConfig, SwarmConfig
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.round import RoundRules, swarm_rules
from p2pdiloco.protocol.timing import GracePolicy, RoundClock
from p2pdiloco.sim.learners import Board, IslandMerger, Sender, Wire
from p2pdiloco.sim.timeline import Deferred, Runner, Timeline
from p2pdiloco.training.data import BatchStream, load_data, order_seed, stream_seed, validation_batches, \
    bits_per_byte_factor
from p2pdiloco.core.fragments import Stagger
from p2pdiloco.training.diloco import DiLoCo
from p2pdiloco.training.fragments import Streams, model_fragments
from p2pdiloco.training.inner import InnerTrainer, evaluate, flat_params
from p2pdiloco.training.model import build_model, resolve_config
from p2pdiloco.training.tokenizer import vocab_size

@dataclass(frozen=True)
class Setup:
    """What every row shares. `steps`: inner steps per learner (data-parallel: steps of M× the batch)."""

    data: tuple[str, ...] = ()  # prepared datasets or text (training.data.load_data); () = the built-in corpus
    tokenizer: Optional[str] = None
    model: str = "tiny"
    batch_size: int = 8
    seq_len: int = 128
    inner_lr: float = 1e-3
    warmup_steps: int = 20
    grad_clip: float = InnerConfig().grad_clip  # a peer's; every row clips alike (0: none)
    beta1: float = InnerConfig().beta1  # AdamW's, a peer's; every row alike
    beta2: float = InnerConfig().beta2
    lr_schedule: str = "constant"  # or cosine / wsd, decaying over the row's budget (steps × M × batch tokens)
    min_lr_ratio: float = InnerConfig().min_lr_ratio
    outer_lr: float = OuterConfig().lr  # a peer's defaults
    outer_momentum: float = OuterConfig().momentum
    learners: int = 4
    steps: int = 400
    eval_every: int = 50
    eval_batches: int = 16
    seed: int = 0
    run: str = "parity"
    device: str = "cpu"  # the inner steps' (cuda: bf16 autocast, as a GPU peer); Θ stays in host memory

    def inner(self, batch_size: Optional[int] = None) -> InnerConfig:
        budget = None if self.lr_schedule == "constant" else self.total_tokens
        return InnerConfig(batch_size=batch_size or self.batch_size, seq_len=self.seq_len, lr=self.inner_lr,
                           warmup_steps=self.warmup_steps, lr_schedule=self.lr_schedule, total_tokens=budget,
                           min_lr_ratio=self.min_lr_ratio, grad_clip=self.grad_clip,
                           beta1=self.beta1, beta2=self.beta2)

    @property
    def total_tokens(self) -> int:
        """The row's budget, all learners' tokens together: the swarm's --total-tokens."""
        return self.steps * self.learners * self.batch_size * self.seq_len


@dataclass(frozen=True)
class Bench:
    """The data, the model's config and the validation windows: loaded once, shared by every row."""

    setup: Setup
    data: object
    model_config: object
    val: list
    bpb_factor: float

    @classmethod
    def load(cls, setup: Setup) -> "Bench":
        data = load_data(setup.data, setup.tokenizer)
        config = resolve_config(setup.model, vocab_size(data.tokenizer), setup.seq_len, None)
        val = validation_batches(data.val, setup.eval_batches, setup.batch_size, setup.seq_len)
        return cls(setup, data, config, val, bits_per_byte_factor(val, data.tokenizer))

    @property
    def device(self) -> torch.device:
        return torch.device(self.setup.device)

    def model(self, seed: int) -> torch.nn.Module:
        return build_model(self.model_config, seed)

    def stream(self, name: str, batch_size: int) -> BatchStream:
        run = f"{self.setup.run}-{self.setup.seed}"
        return BatchStream(self.data.sources, batch_size, self.setup.seq_len, seed=stream_seed(name, run),
                           run_seed=order_seed(run))

    def n_params(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.model(self.setup.seed).parameters())

    def learner(self, name: str) -> tuple[InnerTrainer, GlobalState]:
        """A learner's trainer and global state, from the run's one initial Θ (as every peer of a swarm starts)."""
        s = self.setup
        model = self.model(s.seed)
        state = GlobalState(flat_params(model).clone(), s.outer_lr, s.outer_momentum)
        return InnerTrainer(model.to(self.device), self.stream(name, s.batch_size), s.inner(), self.device), state

    def bpb(self, model: torch.nn.Module, params: Optional[torch.Tensor] = None) -> float:
        return evaluate(model, self.val, self.device, params=params) * self.bpb_factor


@dataclass
class Curve:
    """Validation bits per byte against the tokens trained (all learners' together)."""

    tokens: list[int] = field(default_factory=list)
    bpb: list[float] = field(default_factory=list)
    notes: dict = field(default_factory=dict)

    def add(self, tokens: int, bpb: float) -> None:
        self.tokens.append(int(tokens))
        self.bpb.append(round(float(bpb), 5))

    @property
    def final(self) -> float:
        return self.bpb[-1]


def data_parallel(bench: Bench) -> Curve:
    s = bench.setup
    torch.manual_seed(s.seed)
    model = bench.model(s.seed).to(bench.device)
    batch = s.batch_size * s.learners
    trainer = InnerTrainer(model, bench.stream("data-parallel", batch), s.inner(batch), bench.device)
    curve = Curve()
    curve.add(0, bench.bpb(model))
    for step in range(1, s.steps + 1):
        trainer.train_step()
        if step % s.eval_every == 0 or step == s.steps:
            curve.add(step * batch * s.seq_len, bench.bpb(model))
    return curve


@dataclass
class Learner:
    name: str
    diloco: DiLoCo


# the learners of a synchronous row train one after another, so the first one's round waits at the barrier for the
# others' H steps each: 10 minutes were not enough for 3 learners of 27 M parameters at 2 s a step on a CPU
SYNC_WAIT = 24 * 3600.0


def sync_rules(h: int, wire: Optional[Wire] = None) -> RoundRules:
    """Synchronous rounds: everyone waits for everyone at the same version, then one island merges them all."""
    return RoundRules(mode="sync", sync_wait=SYNC_WAIT, overlap_steps=h, grace=GracePolicy(floor=30.0, cap=60.0),
                      poll=0.05, rda_segments=wire.rda_segments if wire else ())


def learners(bench: Bench, board: Board, rules: RoundRules, m: int) -> list[Learner]:
    made = []
    for i in range(m):
        name = f"learner{i}"
        trainer, state = bench.learner(name)
        clock = RoundClock()
        merger = IslandMerger(board, name, rules, board.wire.feedback(), clock)
        diloco = DiLoCo(trainer, state, merger, name, name, clock=clock)
        board.publish(name, state)
        made.append(Learner(name, diloco))
    return made


def round_lengths(steps: int, h: int, first: Optional[int] = None) -> list[int]:
    """Inner steps of each round: H each; with `first`, the first H steps merged in rounds of `first` steps."""
    if first and h % first:
        raise ValueError(f"the first rounds' length ({first}) must divide H ({h}): a row trains the setup's steps")
    lengths = [h] * (steps // h)
    if first and lengths:
        lengths[:1] = [first] * (h // first)
    return lengths


def diloco(bench: Bench, h: int, wire: Wire, m: Optional[int] = None, first: Optional[int] = None,
           after_merge: Optional[Callable[[list[Learner]], None]] = None) -> Curve:
    """M learners (default: the setup's), H inner steps each between synchronous rounds (`first`:
    `round_lengths`). `after_merge(learners)`: a probe's change to them once each round has merged
    (scripts/probes/probe_shared_moments.py)."""
    m = m or bench.setup.learners
    if m != bench.setup.learners:  # a learner alone: its budget (the schedule's) is its own tokens
        bench = dataclasses.replace(bench, setup=dataclasses.replace(bench.setup, learners=m))
    s = bench.setup
    torch.manual_seed(s.seed)
    board = Board(wire, bench.n_params())
    group = learners(bench, board, sync_rules(h, wire), m)
    lead = group[0].diloco
    lengths, forks, done = round_lengths(s.steps, h, first), 0, 0
    curve, rounds = Curve(), len(lengths)
    curve.add(0, bench.bpb(lead.trainer.model, lead.state.params))
    try:
        for r, length in enumerate(lengths, start=1):
            for learner in group:
                for _ in range(length):
                    learner.diloco.inner_step()
                learner.diloco.contribute()
            for learner in group:
                settled = learner.diloco.wait(timeout=600)
                if not settled.outcome.committed:
                    raise RuntimeError(f"{learner.name}'s round {r} was not merged: {settled.outcome.reason}")
                board.publish(learner.name, learner.diloco.state)
            if after_merge is not None:
                after_merge(group)
            forks += len({x.diloco.state.digest for x in group}) - 1
            done += length
            if done % s.eval_every == 0 or r == rounds:
                curve.add(done * m * s.batch_size * s.seq_len, bench.bpb(lead.trainer.model, lead.state.params))
    finally:
        for learner in group:
            learner.diloco.close()
    curve.notes = dict(rounds=rounds, forks=forks)
    return curve


def streaming(bench: Bench, h: int, wire: Wire, fragments: int, overlap: int = 0, in_flight: int = 2,
              flush: bool = True) -> Curve:
    """M learners whose models merge as `fragments` fragments (training.fragments), each fragment in synchronous
    rounds every H steps on the staggered schedule (core.fragments.Stagger), each on its own board (its own
    records, islands and error feedback). A fragment's round is waited for `overlap` steps after it left (the
    steps taken meanwhile are rebased onto its merge, as a peer's delayed application does), at the same step
    on every learner: a run is the same whatever the threads' speed. `flush`: at the end, every fragment with
    unmerged steps merges them, so Θ holds every token trained, as with P = 1, whose last round falls there."""
    s = bench.setup
    torch.manual_seed(s.seed)
    group, boards = [], None
    for i in range(s.learners):
        name = f"learner{i}"
        trainer, state = bench.learner(name)
        if boards is None:
            sizes = [f.size for f in model_fragments(trainer.model, fragments)]
            boards = [Board(wire, size) for size in sizes]
        # no RDA here (bench_parity refuses -rda with -frag): a peer's RDA segments are the whole model's tensors
        merger_for = _island_merger(boards, name, sync_rules(h))
        streams = Streams(trainer, state, merger_for, Stagger(fragments, h, in_flight), name, name)
        for board, part in zip(boards, streams.parts):
            board.publish(name, part.state)
        group.append(streams)
    first = group[0]
    curve, merges, forks = Curve(), 0, 0
    curve.add(0, bench.bpb(first.trainer.model, first.global_params()))
    tokens = s.learners * s.batch_size * s.seq_len
    left: dict[int, int] = {}

    def settle(i: int) -> None:
        nonlocal merges, forks
        for learner in group:
            settled = learner.wait(i, timeout=600)
            if not settled.outcome.committed:
                raise RuntimeError(f"fragment {i}'s round was not merged: {settled.outcome.reason}")
            boards[i].publish(learner.parts[i].name, learner.parts[i].state)
        merges += 1
        forks += len({learner.parts[i].state.digest for learner in group}) - 1

    try:
        for step in range(1, s.steps + 1):
            for learner in group:
                learner.inner_step()
            for i in first.due():
                for learner in group:
                    learner.contribute(i)
                left[i] = step
            for i in [i for i, at in sorted(left.items()) if step - at >= overlap]:
                settle(i)
                del left[i]
            if step % s.eval_every == 0 and step < s.steps:
                curve.add(step * tokens, bench.bpb(first.trainer.model, first.global_params()))
        for i in sorted(left):
            settle(i)
        unflushed = bench.bpb(first.trainer.model, first.global_params())
        if flush:
            for i in first.unsent():
                for learner in group:
                    learner.contribute(i)
                settle(i)
    finally:
        for learner in group:
            learner.close()
    curve.add(s.steps * tokens, bench.bpb(first.trainer.model, first.global_params()))
    curve.notes = dict(fragments=fragments, merges=merges, forks=forks, versions=first.versions,
                       unflushed_bpb=round(unflushed, 5))
    return curve


def _island_merger(boards: list[Board], name: str, rules: RoundRules):
    def merger_for(i: int, clock: RoundClock, state: GlobalState) -> IslandMerger:
        return IslandMerger(boards[i], name, rules, boards[i].wire.feedback(), clock)
    return merger_for


def decoupled_rules(h: int, step_seconds: float, overlap_steps: Optional[int] = None,
                    wire: Optional[Wire] = None) -> RoundRules:
    """A peer's default rules (SwarmConfig's), in simulated seconds: no matchmaking floor, the grace window capped
    at a round of the slowest learner's steps; τ of Eq. 3 (`overlap_steps`) is H unless given, as a peer's; the
    wire's RDA segments, if any."""
    rules = swarm_rules(SwarmConfig(), overlap_steps or h, grace_floor=0.0, grace_cap=h * step_seconds, poll=1.0)
    return dataclasses.replace(rules, rda_segments=wire.rda_segments) if wire else rules


def decoupled(bench: Bench, h: int, wire: Wire, speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 3.0),
              sync_seconds: float = 2.0, eager: bool = False, overlap_steps: Optional[int] = None,
              count: str = "trained") -> Curve:
    """len(speeds) learners, learner i taking speeds[i] simulated seconds per inner step, until they have trained
    the tokens of M learners × the setup's steps; `sync_seconds`: an all-reduce's duration; `eager`: the in-flight
    steps start from an estimate of the next global model (`--application eager`), not from the local model;
    `overlap_steps`: τ of the grace window (Eq. 3; default H, as a peer's).

    `count` says which tokens the budget and the curve count: "trained" (every learner's inner steps, merged or
    not), or "merged" (those merged into the newest global model: the learners train on until it holds the
    budget). A finite run ends with every learner's last steps unmerged (a round's worth for the fast ones, most
    of one for the slow one); synchronous rounds end with none, so "merged" compares the models at equal tokens
    in them. The notes give both counts at the end either way."""
    s = bench.setup
    if count not in ("trained", "merged"):
        raise ValueError(f"count: trained or merged, not {count!r}")
    torch.manual_seed(s.seed)
    board = Board(wire, bench.n_params())
    runners = []
    for i, speed in enumerate(speeds):
        name = f"learner{i}"
        trainer, state = bench.learner(name)
        merger = Deferred()
        diloco = DiLoCo(trainer, state, merger, name, name, eager=eager)
        runners.append(Runner(name, diloco, merger, Sender(name, wire, wire.feedback()), speed))
        board.publish(name, state)
    timeline = Timeline(board, decoupled_rules(h, max(speeds), overlap_steps, wire), runners, h, sync_seconds)
    tokens = len(speeds) * s.batch_size * s.seq_len
    watch = Watch(bench, board, runners[0].diloco.trainer.model, count, s.steps * tokens, s.eval_every * tokens)
    try:
        seconds = timeline.run(watch.keep_training, watch.after_step)
    finally:
        for r in runners:
            if r.answer is not None and not r.answer.done():
                r.answer.cancel()
            r.diloco.close()
    curve = watch.finish()
    curve.notes.update(dict(simulated_seconds=round(seconds, 1), outcomes=timeline.outcomes,
                            stale_merges=timeline.stale_merges, versions=board.newest().version, count=count,
                            tokens_merged=board.newest().tokens,
                            tokens_trained=sum(r.diloco.trainer.total_steps * r.diloco.trainer.tokens_per_step
                                               for r in runners),
                            steps={r.name: r.diloco.trainer.total_steps for r in runners}))
    return curve


@dataclass
class Watch:
    """A decoupled row's budget and curve, in tokens trained or in tokens merged into the newest global model
    (`decoupled`'s `count`), evaluating that model through `model`'s modules."""

    bench: Bench
    board: Board
    model: torch.nn.Module
    count: str
    budget: int
    per_eval: int
    curve: Curve = field(default_factory=Curve)
    evaluated: int = 0  # merged: the last evaluation point passed

    def __post_init__(self):
        self.curve.add(0, self._bpb())

    def _bpb(self) -> float:
        return self.bench.bpb(self.model, self.board.newest().params)

    def keep_training(self, trained: int) -> bool:
        return (trained if self.count == "trained" else self.board.newest().tokens) < self.budget

    def after_step(self, trained: int) -> None:
        if self.count == "trained":
            if trained % self.per_eval == 0 and trained < self.budget:
                self.curve.add(trained, self._bpb())
            return
        merged = self.board.newest().tokens  # once each time a merge passes one evaluation point or more
        if self.evaluated + self.per_eval <= merged < self.budget:
            self.evaluated = merged // self.per_eval * self.per_eval
            self.curve.add(merged, self._bpb())

    def finish(self) -> Curve:
        merged, last = self.board.newest().tokens, self._bpb()
        if self.count == "trained" or merged == self.budget:
            self.curve.add(self.budget, last)
        else:  # the last merge went past the budget: the value at the budget, between the two merges around it
            self.curve.notes["last_merge"] = [merged, round(last, 5)]
            self.curve.add(self.budget, at_tokens(self.curve.tokens[-1], self.curve.bpb[-1], merged, last,
                                                  self.budget))
        return self.curve


def at_tokens(t0: int, b0: float, t1: int, b1: float, t: int) -> float:
    """Bits per byte at `t` tokens, on the straight line between two measured points (an estimate: no model
    of the run holds exactly `t` tokens)."""
    return b0 + (b1 - b0) * (t - t0) / (t1 - t0)
