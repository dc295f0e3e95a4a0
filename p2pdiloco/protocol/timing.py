"""Measured round timing, free of networking: moving averages and the decisions made from them.

Decoupled DiLoCo's Eq. 3 sets how long a peer waits for more island members after quorum:

    grace = γ · (τ·ξ_step − ξ_quorum − ξ_sync)

with ξ exponential moving averages of the inner step time, the time to reach quorum and the time to
synchronize, and τ the inner steps a round may take while in flight. Idle network slack thus becomes more
merged members, and a round never takes longer than the compute it overlaps. The same measurements set the
all-reduce deadline from the link speed actually observed rather than from a declared one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Ema:
    """Exponential moving average; the first sample initialises it (no bias towards zero)."""

    alpha: float = 0.3
    value: Optional[float] = None

    def update(self, sample: float) -> float:
        if not math.isfinite(sample) or sample < 0:
            return self.get()  # a clock glitch or an aborted measurement must not poison the average
        self.value = sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


@dataclass(frozen=True)
class GracePolicy:
    gamma: float = 0.5  # γ < 1: leave part of the slack unused, so rounds finish within the overlap budget
    floor: float = 1.5  # hivemind needs matchmaking to outlast its request timeout
    cap: float = 60.0


@dataclass
class RoundClock:
    """The EMAs one peer keeps about its own rounds; every field is measured, none is configured."""

    step: Ema = field(default_factory=Ema)  # seconds per inner step (throttle included: it is wall time)
    quorum: Ema = field(default_factory=Ema)  # seconds from ready until K−1 others were ready too
    sync: Ema = field(default_factory=Ema)  # seconds from group formed until the all-reduce returned
    throughput: Ema = field(default_factory=Ema)  # bytes per second moved by this peer in all-reduces

    def grace(self, overlap_steps: int, policy: GracePolicy = GracePolicy()) -> float:
        """Eq. 3, clipped: at least hivemind's floor, at most the cap."""
        slack = overlap_steps * self.step.get() - self.quorum.get() - self.sync.get()
        return min(policy.cap, max(policy.floor, policy.gamma * slack))

    def allreduce_budget(self, wire_bytes: float, declared_bytes_per_s: float, slack: float = 3.0,
                         factor: float = 3.0) -> float:
        """Deadline for one all-reduce: `factor`× the time the measured link speed predicts, plus slack.
        Until a round has been measured, the declared link speed stands in."""
        rate = self.throughput.get(declared_bytes_per_s)
        return slack + factor * wire_bytes / max(rate, 1.0)


def agreed_deadline(budgets, cap: float) -> float:
    """The all-reduce deadline every member derives from the gathered budgets: the most patient member's,
    within hivemind's cap. A missing, non-numeric, non-finite or negative budget (a hostile or broken peer)
    counts as the cap, so it can neither hang the round nor cut it short for everyone."""
    clean = []
    for b in budgets:
        try:
            b = float(b)
        except (TypeError, ValueError):
            b = cap
        clean.append(b if math.isfinite(b) and b > 0 else cap)
    return min(cap, max(clean, default=cap))


def allreduce_wire_bytes(n_elements: int, group_size: int, bytes_per_element: int = 4) -> int:
    """Bytes one peer sends (and as many it receives) in a butterfly all-reduce of n elements."""
    if group_size <= 1:
        return 0
    return int(2 * (group_size - 1) / group_size * bytes_per_element * n_elements)
