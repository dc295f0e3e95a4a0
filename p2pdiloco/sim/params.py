"""What the goodput simulator assumes, each with its default and why. Nothing here is tuned to reproduce the
Decoupled DiLoCo paper's figures; change them from the command line (`p2pdiloco simulate --help`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from p2pdiloco.config import CHECKPOINT_FLOOR, COMPRESSIONS, ConfigError, SwarmConfig, option

YEAR = 365.25 * 24 * 3600.0
WEEK = 7 * 24 * 3600.0
MODES = ("dp", "elastic", "sync-diloco", "decoupled", "central")
FAILURES = ("auto", "elastic", "restart")
PEER = SwarmConfig()  # the round rules' defaults are a peer's: one source, so the two cannot drift apart


@dataclass(frozen=True, kw_only=True)
class SimParams:
    chips: int = option(1_200_000, "Accelerator chips in the whole run.", group="sim")
    learners: int = option(8, "M: learners (islands) the chips are split into, equally.", group="sim")
    mtbi_years: float = option(1.0, "Mean time between interruptions of one chip, in years.", group="sim")
    failure: str = option(
        "auto", "What a chip failure does to a learner (sync-diloco, decoupled, central). elastic, the paper's: "
        "the learner stalls --rescale-seconds, trains on without the failed slice, and stalls "
        "--upscale-seconds when it returns; it keeps its progress. restart, a p2pdiloco peer's: the whole "
        "process dies, restarts after --repair-seconds, loads its newest local checkpoint "
        "(--checkpoint-seconds), downloads the state it lacks, and loses the work since that checkpoint. "
        "auto: elastic for learners larger than a slice, restart for peers of one machine.",
        choices=FAILURES, group="sim")
    repair_seconds: float = option(
        60.0, "A job (dp) or a restarting learner is back after this long on a hot spare (a learner then also "
        "downloads the state); elastic: a failed slice returns after this long. Failures during a restart are "
        "handled by it.", group="sim")
    rescale_seconds: float = option(
        20.0, "elastic: the downscale stall of everyone in the data-parallel job or learner that drops a failed "
        "slice (failures during it are dropped by the same rescale).", group="sim")
    upscale_seconds: float = option(
        0.0, "elastic: the stall when a repaired slice rejoins. 0: the 20 s downscale alone already gives elastic "
        "data-parallel the paper's 58 % (56 %), and the sources do not split the stall.", group="sim")
    slice_chips: int = option(256, "elastic: chips dropped together when one of them fails.", group="sim")
    checkpoint_seconds: float = option(
        CHECKPOINT_FLOOR, "restart: a learner writes its own progress to a local checkpoint this often and keeps it "
        f"over a restart: a peer of a small model does every {CHECKPOINT_FLOOR:g} s by default (join "
        "--checkpoint-seconds); 0: never, as "
        "peers did before 2026-11-29.", group="sim")
    step_seconds: float = option(1.0, "Seconds per inner step of the fastest learner.", group="sim")
    speed_spread: float = option(
        0.0, "Learner i's step takes step_seconds·(1 + spread·uᵢ), uᵢ uniform in [0, 1) from the seed.",
        group="sim")
    inner_steps: int = option(100, "H: inner steps per round of sync-diloco and decoupled learners.",
                              flag="inner-steps", short="-H", group="sim")
    model_params: int = option(5_000_000_000, "Parameters of the model: the bytes of all-reduces and state "
                               "downloads (the paper's 5B dense model).", group="sim")
    compression: str = option(PEER.compression, "The pseudo-gradients' wire format (join --compression).",
                              choices=COMPRESSIONS, group="sim")
    bandwidth_gbit: float = option(5.0, "Each learner's link, in Gbit/s (the paper's regions: 2-5).", group="sim")
    latency_ms: float = option(50.0, "One-way latency between learners, in ms.", group="sim")
    sync_seconds: Optional[float] = option(
        None, "An outer all-reduce's time, measured (sim_vs_chaos). Default: from the model's size, the wire's "
        "bytes, the island's size and the link.", group="sim")
    join_seconds: Optional[float] = option(
        None, "A learner's time to find and join an island, measured. Default: three round trips.", group="sim")
    quorum: int = option(PEER.quorum, "decoupled: K, fewest learners for a merge (join --quorum).", group="sim")
    grace_gamma: float = option(PEER.grace_gamma, "decoupled: γ of the grace window (Eq. 3; join --grace-gamma).",
                                group="sim")
    max_staleness: int = option(PEER.max_staleness, "decoupled: contribute from up to this many versions behind "
                                "(join --max-staleness).", group="sim")
    wait_for_newest: bool = option(PEER.wait_for_newest, "decoupled: wait for learners on a newer state rather than "
                                   "form an island that forks it (join --wait-for-newest).", group="sim")
    wait_for_island: bool = option(PEER.wait_for_island, "decoupled: a learner that finds an island merging from "
                                   "its state without it waits for that island and takes its state "
                                   "(join --wait-for-island).", group="sim")
    fragments: int = option(PEER.fragments, "decoupled: Streaming DiLoCo's P (join --fragments): each learner merges "
                            "the model as P fragments, each in rounds of its own on a peer's stagger and with 1/P of "
                            "the bytes; a failure takes all of a learner's fragments down.", group="sim")
    fragments_in_flight: int = option(PEER.fragments_in_flight, "decoupled: τ of --fragments, the most fragments' "
                                      "rounds a learner has out at once (join --fragments-in-flight).", group="sim")
    days: float = option(7.0, "Simulated days.", group="sim")
    seed: int = option(0, "Failure times and learner speeds are drawn from this seed.", group="sim")

    def __post_init__(self):
        for name in ("chips", "learners", "inner_steps", "slice_chips", "quorum", "model_params", "fragments",
                     "fragments_in_flight"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be a positive integer")
        if self.fragments > self.inner_steps:  # as a peer: a fragment's round at most once a step
            raise ConfigError(f"fragments ({self.fragments}) cannot exceed H ({self.inner_steps})")
        if self.learners > self.chips:
            raise ConfigError(f"learners ({self.learners}) cannot exceed chips ({self.chips})")
        for name in ("mtbi_years", "step_seconds", "days"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"{name.replace('_', ' ')} must be a positive number")
        if not (math.isfinite(self.bandwidth_gbit) and self.bandwidth_gbit > 0):
            raise ConfigError("bandwidth gbit must be a positive number")
        for name in ("repair_seconds", "rescale_seconds", "upscale_seconds", "checkpoint_seconds", "sync_seconds",
                     "join_seconds", "latency_ms", "speed_spread"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name.replace('_', ' ')} must be >= 0")
        if self.failure not in FAILURES:
            raise ConfigError(f"failure must be one of {', '.join(FAILURES)}, got {self.failure!r}")
        self.swarm()  # the peer's own checks of the round rules (quorum, γ, staleness)

    @property
    def horizon(self) -> float:
        return self.days * 24 * 3600.0

    @property
    def mtbi_seconds(self) -> float:
        return self.mtbi_years * YEAR

    @property
    def learner_failure(self) -> str:
        """What a failure does to a learner: `auto` is the paper's elastic model for learners of many chips (a
        learner larger than one slice can drop one), and a peer's restart for peers of one machine."""
        if self.failure != "auto":
            return self.failure
        return "elastic" if self.learner_chips(self.learners - 1) > self.slice_chips else "restart"

    def swarm(self) -> SwarmConfig:
        """The peer configuration the simulated learners run: the round rules come from it, as a peer's do."""
        return SwarmConfig(quorum=self.quorum, grace_gamma=self.grace_gamma, max_staleness=self.max_staleness,
                           wait_for_newest=self.wait_for_newest, wait_for_island=self.wait_for_island,
                           compression=self.compression, fragments=self.fragments,
                           fragments_in_flight=self.fragments_in_flight)

    def learner_chips(self, i: int) -> int:
        """Chips of learner i: an equal split, the remainder spread over the first learners."""
        base, extra = divmod(self.chips, self.learners)
        return base + (1 if i < extra else 0)
