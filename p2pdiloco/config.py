"""Typed configuration: one dataclass per concern, validated on construction with actionable messages.

Pure Python (no torch import) so the CLI can build and validate a config before paying for heavy imports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


WEIGHTINGS = ("tokens2", "tokens", "uniform")  # p2pdiloco.core.outer.merge_weights implements them
APPLICATIONS = ("delayed", "eager")  # how a peer trains while its round is in flight (p2pdiloco.training.diloco)
MODES = ("decoupled", "sync")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only byte-level transformer; `n_params` is approximate (embeddings are tied)."""

    d_model: int
    n_layers: int
    n_heads: int
    vocab_size: int = 256  # bytes: no tokenizer to ship or download
    max_seq_len: int = 1024

    @property
    def n_params(self) -> int:
        return 12 * self.n_layers * self.d_model**2 + self.vocab_size * self.d_model


MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=128, n_layers=4, n_heads=4),  # ~0.8M: tests, laptops
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=4),  # ~3M: the CPU demo
    "base": ModelConfig(d_model=384, n_layers=6, n_heads=6),  # ~11M
    "medium": ModelConfig(d_model=512, n_layers=8, n_heads=8),  # ~25M
    "large": ModelConfig(d_model=768, n_layers=14, n_heads=12),  # ~100M: one GPU
}


def model_config(name: str) -> ModelConfig:
    if name not in MODEL_SIZES:
        raise ConfigError(f"unknown model size {name!r}; choose one of: {', '.join(MODEL_SIZES)}")
    return MODEL_SIZES[name]


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    """Local training between two outer rounds."""

    steps: int = 50  # H: inner steps per round
    lr: float = 1e-3  # AdamW learning rate
    warmup_steps: int = 20  # linear warm-up of the inner lr, counted over the peer's whole life
    weight_decay: float = 0.1
    batch_size: int = 16
    seq_len: int = 128
    grad_clip: float = 1.0
    round_seconds: Optional[float] = None  # time-budgeted H: contribute every this many seconds instead

    def __post_init__(self):
        _positive(self, "steps", "batch_size", "seq_len")
        if self.round_seconds is not None:
            _positive_float(self, "round_seconds")
        _positive_float(self, "lr")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("inner warmup_steps, weight_decay and grad_clip must be >= 0")


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer Nesterov SGD step applied identically by every member of a round."""

    lr: float = 0.7
    momentum: float = 0.9
    weighting: str = "tokens2"  # merge weights: tokens²/steps (Decoupled DiLoCo), tokens, or uniform
    rda: bool = False  # radial-directional averaging of non-embedding tensors
    application: str = "delayed"  # while a round is in flight: go on from θ (delayed) or from an estimate of Θ'

    def __post_init__(self):
        _positive_float(self, "lr")
        if self.application not in APPLICATIONS:
            raise ConfigError(f"application must be one of {', '.join(APPLICATIONS)}, got {self.application!r}")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"outer momentum must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    """How this peer meets others. Loopback and no NAT probing unless asked for."""

    run_id: str = "p2pdiloco"
    initial_peers: tuple[str, ...] = ()
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce: tuple[str, ...] = ()
    identity: Optional[Path] = None  # private key file: a stable peer id across restarts
    nat_traversal: bool = False  # hivemind's nat_port_map/auto_nat/use_relay; off: they probe real interfaces
    mode: str = "decoupled"  # decoupled: rounds run in the background; sync: everyone waits for everyone
    quorum: int = 1  # K: fewest members (this peer included) for a round to merge
    max_island: int = 16  # largest group that one all-reduce forms
    grace_gamma: float = 0.5  # γ of the adaptive grace window (Eq. 3), < 1
    overlap_steps: Optional[int] = None  # τ: inner steps a round may run in flight; default H
    max_staleness: int = 2  # contribute from up to this many versions behind; further behind: resync first
    sync_wait: float = 60.0  # sync mode: longest wait at the round barrier for peers still training
    bandwidth_mbps: float = 100.0  # assumed link speed until measured; sets all-reduce timeouts
    connect_timeout: float = 20.0  # give up on unreachable initial peers after this many seconds

    def __post_init__(self):
        if not self.run_id or not all(c.isalnum() or c in "-_" for c in self.run_id):
            raise ConfigError(f"run id must be non-empty letters, digits, '-' or '_', got {self.run_id!r}")
        _positive(self, "quorum", "max_island")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0.0 < self.grace_gamma < 1.0:
            raise ConfigError(f"grace gamma must be in (0, 1), got {self.grace_gamma}")
        if self.overlap_steps is not None:
            _positive(self, "overlap_steps")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"max staleness must be an integer >= 0, got {self.max_staleness!r}")
        if self.quorum > self.max_island:
            raise ConfigError(f"quorum ({self.quorum}) cannot exceed max island size ({self.max_island})")
        _positive_float(self, "sync_wait", "bandwidth_mbps", "connect_timeout")
        for addr in (*self.initial_peers, *self.listen, *self.announce):
            if not addr.startswith("/"):
                raise ConfigError(f"{addr!r} is not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...)")


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """Everything one peer needs; built by the CLI from flags, a profile and defaults."""

    model: str = "small"
    data: Optional[Path] = None  # a text file or a folder of them; None: the built-in corpus
    seed: int = 0  # initial weights (identical for every peer of a run)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    max_rounds: Optional[int] = None
    max_time: Optional[float] = None  # seconds of training before leaving
    eval_batches: int = 8  # validation batches of the shared held-out split, per evaluation
    eval_every: int = 1  # evaluate after every this many merged rounds; 0: only at start and end
    throttle: float = 1.0  # >1 slows each inner step by this factor (tests of heterogeneous peers)
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    device: str = "auto"
    log_dir: Path = Path("runs/logs")
    checkpoint_dir: Path = Path("runs/checkpoints")
    checkpoint_every: int = 5  # merged rounds between checkpoints (one is always written on leaving); 0: never
    keep_checkpoints: int = 3
    name: Optional[str] = None  # label for logs and metrics; default: a short form of the peer id

    def __post_init__(self):
        model_config(self.model)
        if self.data is not None and not Path(self.data).exists():
            raise ConfigError(f"--data {self.data}: no such file or folder")
        for name in ("max_rounds", "max_time"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.throttle < 1.0 or not math.isfinite(self.throttle):
            raise ConfigError(f"throttle must be a finite factor >= 1, got {self.throttle}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _positive(self, "eval_batches")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint every must be an integer >= 0, got {self.checkpoint_every!r}")
        _positive(self, "keep_checkpoints")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"eval every must be an integer >= 0, got {self.eval_every!r}")

    def replace(self, **changes) -> "PeerConfig":
        return dataclasses.replace(self, **changes)


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name.replace('_', ' ')} must be a positive integer, got {value!r}")


def _positive_float(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{name.replace('_', ' ')} must be a positive number, got {value!r}")
