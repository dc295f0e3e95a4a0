"""The modes the decoupled swarm is compared against, on the same failure draws.

dp:          one data-parallel job over every chip; any failure stops everyone until the restart (repair) is done.
elastic:     data-parallel, but a failed slice is dropped after a rescale stall; it rejoins once repaired.
sync-diloco: M learners under the learners' failure model, with a barrier per round: every learner waits for the
             slowest (or the one restarting), then all sync.
Goodput is useful chip-time over allocated chip-time; uptime the share of time some useful work is running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from p2pdiloco.sim.failures import Draws, learner_clocks, merged_failures, union_length
from p2pdiloco.sim.lifeline import WorkClock, checkpoint_before, clip, elastic_spans, restart_spans
from p2pdiloco.sim.params import SimParams
from p2pdiloco.sim.sizes import allreduce_seconds


@dataclass
class SimResult:
    mode: str
    goodput: float
    uptime: float
    failures: int
    rounds: int = 0  # outer steps (commits of the global model); dp/elastic: none
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(mode=self.mode, goodput=self.goodput, uptime=self.uptime, failures=self.failures,
                    rounds=self.rounds, **self.details)


def simulate_dp(p: SimParams, d: Draws) -> SimResult:
    """Every chip is one job: each failure stops it for a restart from its in-memory checkpoint."""
    failures = merged_failures(d)
    spans = restart_spans(failures, p.chips, p.repair_seconds, min(d.step_seconds), p.horizon)
    useful = [(s.start, s.end) for s in spans]
    work = sum(b - a for a, b in useful)
    return SimResult("dp", work / p.horizon, union_length(useful) / p.horizon, len(failures))


def simulate_elastic(p: SimParams, d: Draws) -> SimResult:
    """Elastic data-parallel: one learner of every chip under the elastic failure model."""
    failures = merged_failures(d)
    spans = elastic_spans(failures, p.chips, p.slice_chips, p.repair_seconds, p.rescale_seconds,
                          p.upscale_seconds, min(d.step_seconds), p.horizon)
    chip_seconds = sum(s.chips * (s.end - s.start) for s in spans)
    useful = [(s.start, s.end) for s in spans]
    return SimResult("elastic", chip_seconds / (p.chips * p.horizon), union_length(useful) / p.horizon,
                     len(failures))


def _round_of(p: SimParams, work: WorkClock, needed: float, start: float) -> tuple[float, list]:
    """One learner's round of `needed` seconds of work from `start`: when it ends, and the work it carries. A
    death in it (restart) keeps what the newest local checkpoint holds, and the learner makes up the rest."""
    kept: list = []
    while True:
        end = work.wall_after(start, needed - sum(work.work_at(b) - work.work_at(a) for a, b in kept))
        death = work.death_in(start, end) if end < math.inf else None
        if death is None:
            return end, kept + [(start, end)]
        kept = clip(kept + [(start, death.end)], checkpoint_before(death, death.end, p.checkpoint_seconds))
        start = work.next_start(death.end)


def simulate_sync_diloco(p: SimParams, d: Draws) -> SimResult:
    """A barrier per round: every learner waits for the slowest (or the one restarting), then all sync. A learner
    that fails while waiting at the barrier or syncing has handed its work over already."""
    clocks = learner_clocks(p, d)
    sync = allreduce_seconds(p, p.learners)
    useful, chip_seconds, rounds, t = [], 0.0, 0, 0.0
    while t < p.horizon:
        ends, carried = zip(*(_round_of(p, work, p.inner_steps * d.step_seconds[i], t)
                              for i, work in enumerate(clocks)))
        barrier = max(ends)
        if barrier > p.horizon:
            break
        rounds += 1
        for work, intervals in zip(clocks, carried):
            for a, b in intervals:
                useful.extend(work.pieces(a, b))
                chip_seconds += work.chip_seconds(a, b)
        t = barrier + sync
    failures = sum(len(f) for f in d.failures)
    return SimResult("sync-diloco", chip_seconds / (p.chips * p.horizon), union_length(useful) / p.horizon, failures,
                     rounds, details=dict(failure=p.learner_failure))
