"""What the goodput simulator assumes, each with its default and why. Nothing here is tuned to reproduce the
Decoupled DiLoCo paper's figures; change them from the command line (`p2pdiloco simulate --help`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pdiloco.config import ConfigError, option

YEAR = 365.25 * 24 * 3600.0
WEEK = 7 * 24 * 3600.0
MODES = ("dp", "elastic", "sync-diloco", "decoupled")


@dataclass(frozen=True, kw_only=True)
class SimParams:
    chips: int = option(1_200_000, "Accelerator chips in the whole run.", group="sim")
    learners: int = option(8, "M: learners (islands) the chips are split into, equally.", group="sim")
    mtbi_years: float = option(1.0, "Mean time between interruptions of one chip, in years.", group="sim")
    repair_seconds: float = option(
        60.0, "A job (dp) or learner hit by a failure restarts after this long on a hot spare, from an in-memory "
        "checkpoint (dp) or the swarm's state (learners). Failures during a restart are handled by it.",
        group="sim")
    rescale_seconds: float = option(
        20.0, "elastic: every learner stalls this long to drop a failed slice (failures during it are dropped by "
        "the same rescale); a repaired slice rejoins at no extra stall.", group="sim")
    slice_chips: int = option(256, "elastic: chips dropped together when one of them fails.", group="sim")
    step_seconds: float = option(1.0, "Seconds per inner step of the fastest learner.", group="sim")
    speed_spread: float = option(
        0.0, "Learner i's step takes step_seconds·(1 + spread·uᵢ), uᵢ uniform in [0, 1) from the seed.",
        group="sim")
    inner_steps: int = option(100, "H: inner steps per round of sync-diloco and decoupled learners.",
                              flag="inner-steps", short="-H", group="sim")
    sync_seconds: float = option(5.0, "An outer all-reduce among two or more learners (its communication).",
                                 group="sim")
    quorum: int = option(1, "decoupled: K, fewest learners for a merge.", group="sim")
    grace_gamma: float = option(0.5, "decoupled: γ of the grace window (Eq. 3).", group="sim")
    wait_for_newest: bool = option(False, "decoupled: wait for learners on a newer state rather than form an island "
                                   "that forks it (join --wait-for-newest).", group="sim")
    wait_for_island: bool = option(True, "decoupled: a learner that finds an island merging from its state without "
                                   "it waits for that island and takes its state (join --wait-for-island).",
                                   group="sim")
    days: float = option(7.0, "Simulated days.", group="sim")
    seed: int = option(0, "Failure times and learner speeds are drawn from this seed.", group="sim")

    def __post_init__(self):
        for name in ("chips", "learners", "inner_steps", "slice_chips", "quorum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be a positive integer")
        if self.learners > self.chips:
            raise ConfigError(f"learners ({self.learners}) cannot exceed chips ({self.chips})")
        for name in ("mtbi_years", "step_seconds", "days"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"{name.replace('_', ' ')} must be a positive number")
        for name in ("repair_seconds", "rescale_seconds", "sync_seconds", "speed_spread"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(f"{name.replace('_', ' ')} must be >= 0")
        if not 0 < self.grace_gamma < 1:
            raise ConfigError("grace gamma must be in (0, 1)")

    @property
    def horizon(self) -> float:
        return self.days * 24 * 3600.0

    @property
    def mtbi_seconds(self) -> float:
        return self.mtbi_years * YEAR

    def learner_chips(self, i: int) -> int:
        """Chips of learner i: an equal split, the remainder spread over the first learners."""
        base, extra = divmod(self.chips, self.learners)
        return base + (1 if i < extra else 0)
