"""Typed configuration: one dataclass per concern, validated on construction with actionable messages.

Pure Python (no torch import) so the CLI can build and validate a config before paying for heavy imports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


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

    def __post_init__(self):
        _positive(self, "steps", "batch_size", "seq_len")
        _positive_float(self, "lr")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("inner warmup_steps, weight_decay and grad_clip must be >= 0")


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer Nesterov SGD step applied identically by every member of a round."""

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self):
        _positive_float(self, "lr")
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
    quorum: int = 1  # K: fewest members (this peer included) for a round to merge
    max_island: int = 16  # largest group that one all-reduce forms
    sync_wait: float = 60.0  # longest wait at the round barrier for peers that are still training
    bandwidth_mbps: float = 100.0  # assumed link speed until measured; sets all-reduce timeouts
    connect_timeout: float = 20.0  # give up on unreachable initial peers after this many seconds

    def __post_init__(self):
        if not self.run_id or not all(c.isalnum() or c in "-_" for c in self.run_id):
            raise ConfigError(f"run id must be non-empty letters, digits, '-' or '_', got {self.run_id!r}")
        _positive(self, "quorum", "max_island")
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
    throttle: float = 1.0  # >1 slows each inner step by this factor (tests of heterogeneous peers)
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    device: str = "auto"
    log_dir: Path = Path("runs/logs")
    checkpoint_dir: Path = Path("runs/checkpoints")
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
