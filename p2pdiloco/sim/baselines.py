"""The three modes the decoupled swarm is compared against, on the same failure draws.

dp:          one data-parallel job over every chip; any failure stops everyone until the restart (repair) is done.
elastic:     data-parallel, but a failed slice is dropped after a rescale stall; it rejoins once repaired.
sync-diloco: M learners, each restarting alone on a failure (losing its round's work), with a barrier per round:
             every learner waits for the slowest (or the one being repaired), then all sync.
Goodput is useful chip-time over allocated chip-time; uptime the share of time some useful work is running.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pdiloco.sim.failures import Draws, merged_failures, union_length
from p2pdiloco.sim.params import SimParams


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


def _absorb(failures: list[float], k: int, until: float) -> int:
    """Skip the failures that happen before `until` (handled by the restart or rescale under way)."""
    while k < len(failures) and failures[k] < until:
        k += 1
    return k


def simulate_dp(p: SimParams, d: Draws) -> SimResult:
    failures, horizon, step = merged_failures(d), p.horizon, min(d.step_seconds)
    useful = []
    t, k = 0.0, 0
    while t < horizon:
        end = failures[k] if k < len(failures) else horizon
        run = end - t
        done = run if end >= horizon else run - run % step  # a failure loses the step in progress
        if done > 0:
            useful.append((t, t + done))
        if end >= horizon:
            break
        t = end + p.repair_seconds
        k = _absorb(failures, k + 1, t)
    work = sum(b - a for a, b in useful)
    return SimResult("dp", work / horizon, union_length(useful) / horizon, len(failures))


def simulate_elastic(p: SimParams, d: Draws) -> SimResult:
    failures, horizon, step = merged_failures(d), p.horizon, min(d.step_seconds)
    back: list[float] = []  # when each dropped slice is repaired
    useful, chip_seconds = [], 0.0
    t, k = 0.0, 0
    while t < horizon:
        end = failures[k] if k < len(failures) else horizon
        back = [b for b in back if b > t]
        active = max(0, p.chips - p.slice_chips * len(back))
        run = end - t
        done = run if end >= horizon else run - run % step
        if done > 0 and active:
            useful.append((t, t + done))
            chip_seconds += active * done
        if end >= horizon:
            break
        stall_end = end + p.rescale_seconds
        k2 = _absorb(failures, k + 1, stall_end)
        back.extend([f + p.repair_seconds for f in failures[k:k2]])
        t, k = stall_end, k2
    return SimResult("elastic", chip_seconds / (p.chips * horizon), union_length(useful) / horizon, len(failures))


def simulate_sync_diloco(p: SimParams, d: Draws) -> SimResult:
    horizon, H = p.horizon, p.inner_steps
    sync = p.sync_seconds if p.learners > 1 else 0.0  # alone, there is nobody to sync with
    nxt = [0] * p.learners  # index of each learner's next failure
    down_until = [0.0] * p.learners
    useful, chip_seconds, rounds, t = [], 0.0, 0, 0.0
    while t < horizon:
        finished, blocks = [], []
        for i in range(p.learners):
            f_i, start = d.failures[i], max(t, down_until[i])
            while True:
                end = start + H * d.step_seconds[i]
                k = _absorb(f_i, nxt[i], start)  # failures while waiting at the barrier or syncing: handled
                if k < len(f_i) and f_i[k] < end:  # failed mid-round: the round's work is lost
                    start = down_until[i] = f_i[k] + p.repair_seconds
                    nxt[i] = _absorb(f_i, k + 1, start)
                    continue
                nxt[i] = k
                break
            finished.append(end)
            blocks.append((start, end))
        barrier = max(finished)
        if barrier > horizon:
            break
        rounds += 1
        for i, (a, b) in enumerate(blocks):
            useful.append((a, b))
            chip_seconds += p.learner_chips(i) * (b - a)
        t = barrier + sync
    failures = sum(len(f) for f in d.failures)
    return SimResult("sync-diloco", chip_seconds / (p.chips * horizon), union_length(useful) / horizon, failures,
                     rounds)
