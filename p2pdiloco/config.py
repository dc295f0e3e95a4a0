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
COMPRESSIONS = ("none", "int8", "int4", "int2")  # p2pdiloco.core.codec
INNER_OPTIMIZERS = ("adamw", "adamw8bit")  # p2pdiloco.training.inner.make_optimizer
# timed checkpoints by default (join --checkpoint-seconds): 60 times the last write apart (under 2% of the time;
# measured with scripts/bench/bench_checkpoint.py), and at least this often apart; the simulator's restart model
# takes the floor as its default (a small model's peer)
CHECKPOINT_FACTOR, CHECKPOINT_FLOOR = 60.0, 30.0
METRICS_SINKS = ("tensorboard", "wandb")  # optional, besides the JSONL every peer writes (p2pdiloco.runtime.metrics)


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


def option(default, help: str, *, flag: Optional[str] = None, short: Optional[str] = None,
           choices: Optional[tuple[str, ...]] = None, metavar: Optional[str] = None, group: str = "train",
           hidden: bool = False, envvar: Optional[str] = None, factory=None):
    """A config field that is also a command-line option: its default, type (from the annotation) and help are
    written here once, and p2pdiloco.cli derives the click option from them. `flag` names the option where the
    field's own name would be ambiguous on the command line (e.g. InnerConfig.lr is --inner-lr)."""
    meta = dict(help=help, flag=flag, short=short, choices=choices, metavar=metavar, group=group, hidden=hidden,
                envvar=envvar)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Llama-family decoder (RoPE, SwiGLU, RMSNorm, grouped-query attention) without its vocabulary, which the
    tokenizer sets. `p2pdiloco.training.model` turns it into a `transformers.LlamaConfig`."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int  # grouped-query attention: each key/value head serves heads / kv_heads query heads
    intermediate: int  # SwiGLU's inner width
    tied: bool = True  # the output head is the input embedding
    rope_theta: float = 10000.0
    recipe: str = ""  # whose published shape this is

    def n_params(self, vocab: int) -> int:
        head = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head
        per_layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + vocab * self.hidden * (1 if self.tied else 2) + self.hidden


def _swiglu(hidden: int) -> int:
    """SwiGLU's width for the parameters of a 4x GELU MLP (8/3 of the width), rounded up to a multiple of 32."""
    return -(-8 * hidden // 3 // 32) * 32


# The small presets keep the widths and depths of the byte-level GPT they replace, so the memory and speed
# figures of docs/hardware.md stay comparable; the three largest take published shapes.
MODEL_PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=_swiglu(128)),  # ~0.8M: tests
    "small": ModelShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=_swiglu(256)),  # ~3M: the CPU demo
    "base": ModelShape(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=_swiglu(384)),  # ~10M
    "medium": ModelShape(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=_swiglu(512)),  # ~25M
    "large": ModelShape(hidden=768, layers=14, heads=12, kv_heads=4, intermediate=_swiglu(768)),  # ~90M: one GPU
    "xl": ModelShape(hidden=1024, layers=24, heads=16, kv_heads=8, intermediate=_swiglu(1024)),  # ~280M
    "135m": ModelShape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, recipe="SmolLM-135M"),
    "360m": ModelShape(hidden=960, layers=32, heads=15, kv_heads=5, intermediate=2560, recipe="SmolLM-360M"),
    "1b": ModelShape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, rope_theta=500000.0,
                     recipe="Llama-3.2-1B"),
}


def model_preset(name: str) -> ModelShape:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {', '.join(MODEL_PRESETS)}, or give a "
                          "config.json, a model folder or a hub id")
    return MODEL_PRESETS[name]


def looks_like_hub_id(name: str) -> bool:
    """`org/name` (as the hub spells ids), not a path on this machine."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and all(
        c.isalnum() or c in "-_." for c in name.replace("/", ""))


def check_model_source(flag: str, value: str) -> None:
    """A preset name, an existing file or folder, or a hub id; what each holds is checked when it is loaded."""
    if value in MODEL_PRESETS or Path(value).exists() or looks_like_hub_id(value):
        return
    raise ConfigError(f"{flag} {value}: not a preset ({', '.join(MODEL_PRESETS)}), not an existing config.json or "
                      "model folder, and not a hub id (org/name)")


LR_SCHEDULES = ("constant", "cosine", "wsd")


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    """Local training between two outer rounds."""

    steps: int = option(50, "Inner steps per round (H).", flag="inner-steps", short="-H")
    lr: float = option(1e-3, "AdamW learning rate of the inner steps.", flag="inner-lr")
    warmup_steps: int = option(
        20, "Linear warm-up of the inner lr over the swarm's first this many steps' worth of tokens (of this "
        "peer's batch size and sequence length), counted in tokens merged into the global model.")
    lr_schedule: str = option(
        "constant", "Inner lr after the warm-up, keyed to the swarm's progress (tokens merged into the global "
        "model, carried with it): constant, cosine (to --min-lr-ratio at --total-tokens) or wsd (constant, then "
        "a linear decay over the last --decay-fraction of --total-tokens).", choices=LR_SCHEDULES)
    total_tokens: Optional[int] = option(
        None, "The swarm's token budget, which cosine and wsd decay over (e.g. 3000000000).")
    min_lr_ratio: float = option(0.1, "Where cosine and wsd end, as a fraction of --inner-lr.")
    decay_fraction: float = option(0.2, "wsd: the part of --total-tokens the decay takes.")
    weight_decay: float = 0.1
    beta1: float = option(0.9, "AdamW's first-moment decay for the inner steps.", flag="adam-beta1")
    beta2: float = option(
        0.999, "AdamW's second-moment decay for the inner steps. At a peer's batches of thousands "
        "of tokens 0.999 measured better than 0.95, the large-batch LLM setting (docs/parity.md); a step of "
        "millions of tokens (a large --accumulate) may want 0.95.", flag="adam-beta2")
    batch_size: int = option(16, "Sequences per micro-batch (an inner step takes --accumulate of them).")
    accumulate: int = option(
        1, "Micro-batches of --batch-size whose gradients one inner step sums (gradient accumulation): a step "
        "of accumulate × batch-size sequences in the activations' memory of one micro-batch. Larger steps per "
        "peer bring the swarm nearer data-parallel at equal tokens (docs/parity.md).")
    seq_len: int = option(128, "Tokens per sequence.")
    grad_clip: float = option(1.0, "Clip the inner gradients' global norm to this (0: no clipping).")
    step_in_backward: bool = option(
        False, "Step the inner optimizer on each parameter as soon as its gradient is complete, inside the "
        "backward pass: the whole model's gradients are never held at once (4 bytes per parameter less at the "
        "peak), with the same bits as stepping after it. Needs --grad-clip 0: a global norm needs every gradient "
        "before the first step.")
    activation_checkpointing: bool = option(
        False, "Keep only each transformer block's input through the forward pass and recompute the block's "
        "activations in the backward pass: the activations' memory (which grows with batch size × sequence "
        "length) drops to about one block's worth, for one more forward pass of compute per step (~30 %). The "
        "same bits as without it.")
    compile: bool = option(
        False, "Compile each transformer block with torch.compile (inductor), which fuses the Llama's "
        "elementwise work (RMSNorm, RoPE, SwiGLU): on an H200 the 100M Llama ran at 2.2x its eager tokens/s. "
        "The first inner step waits for the compile (~30 s on a GPU, longer on a CPU, which needs a C++ "
        "compiler); the bits differ from eager by float rounding.")
    fsdp: bool = option(
        False, "Under torchrun, shard the model over the member's ranks with FSDP2 (fully_shard per block): each "
        "rank holds 1/N of θ, its gradients and the AdamW moments, for a model too large for one device; rank 0 "
        "also keeps θ whole in host memory for the rounds. Without it the ranks are DDP replicas.")
    round_seconds: Optional[float] = option(
        None, "Time-budgeted H: contribute every this many seconds instead of every H steps.")
    optimizer: str = option(
        "adamw", "Inner optimizer: adamw, or adamw8bit (bitsandbytes' 8-bit AdamW, on CPU and GPU: 2 bytes of "
        "state per parameter instead of 8).", flag="inner-optimizer", choices=INNER_OPTIMIZERS)

    def __post_init__(self):
        _positive(self, "steps", "batch_size", "seq_len", "accumulate")
        if self.step_in_backward and self.accumulate > 1:
            raise ConfigError(f"--step-in-backward steps inside the backward pass, so it cannot sum {self.accumulate} "
                              "micro-batches' gradients first: leave out one of --step-in-backward and --accumulate")
        if self.optimizer not in INNER_OPTIMIZERS:
            raise ConfigError(f"inner optimizer must be one of {', '.join(INNER_OPTIMIZERS)}, got {self.optimizer!r}")
        if self.round_seconds is not None:
            _positive_float(self, "round_seconds")
        _positive_float(self, "lr")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"--adam-{name} must be in [0, 1) (got {getattr(self, name)})")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("inner warmup_steps, weight_decay and grad_clip must be >= 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.lr_schedule != "constant" and not (isinstance(self.total_tokens, int) and self.total_tokens > 0):
            raise ConfigError(f"--lr-schedule {self.lr_schedule} needs --total-tokens: the swarm's token budget it "
                              "decays over")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1] and --decay-fraction in (0, 1], got "
                              f"{self.min_lr_ratio} and {self.decay_fraction}")
        if self.fsdp and (self.optimizer != "adamw" or self.step_in_backward):
            raise ConfigError("--fsdp steps sharded parameters with torch's AdamW: leave out --inner-optimizer "
                              "adamw8bit and --step-in-backward")
        if self.step_in_backward and self.grad_clip > 0:
            raise ConfigError(f"--step-in-backward needs --grad-clip 0 (got {self.grad_clip}): clipping to a global "
                              "norm needs every gradient before the first parameter is stepped")


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer Nesterov SGD step applied identically by every member of a round."""

    lr: float = option(0.7, "Outer Nesterov learning rate.", flag="outer-lr")
    momentum: float = option(
        0.6, "Outer Nesterov momentum (DiLoCo's 0.9 overshot here: rounds that outlast H steps merge each Δ a round "
        "late, and 0.9 raised the merged model's loss; measured in docs/parity.md).", flag="outer-momentum")
    weighting: str = option("tokens2", "Merge weights: tokens²/steps (Decoupled DiLoCo), tokens, or uniform.",
                            choices=WEIGHTINGS)
    rda: bool = option(False, "Radial-directional averaging of non-embedding tensors.")
    max_weight_ratio: float = option(
        2.0, "No member's merge weight above this multiple of its island's median, whatever tokens it claims "
        "(0: no cap). Every peer of a swarm must use the same.")
    max_scale_ratio: float = option(
        2.0, "No member's block maxima above this multiple of its island's median, so no member can coarsen "
        "everyone's quantization (0: no clip). Every peer of a swarm must use the same.")
    max_norm_ratio: float = option(
        2.0, "A member whose claimed pseudo-gradient norm is above this multiple of its island's median has its "
        "merge weight cut to match (0: no cut). Every peer of a swarm must use the same.")
    min_norm_ratio: float = option(
        2.0, "A member whose claimed pseudo-gradient norm is below its island's upper median over this has its merge "
        "weight cut to match (0: no cut): a near-zero update that claims full tokens takes no weight from the "
        "others, and reducers hold every member's codes to at least the norm it claimed. Every peer of a swarm "
        "must use the same.")
    max_influence_ratio: float = option(
        1.0, "No member's weight times its pseudo-gradient's norm (what it adds to the merge) above this multiple "
        "of its island's median: the weight and norm bounds each cap one factor, so together they let a member add "
        "their product (0: no bound). Measured with the robust merge: a liar whose claims are true of its ×100 Δ "
        "raised the honest peers' loss by 4.4 % at 1.5 and 1.6 % at 1, one replaying an old Δ by 1.7 % and 0.9 %, "
        "at +0.1 % on clean runs (docs/hostile.md). Every peer of a swarm must use the same.")
    stale_factor: float = option(
        0.5, "What a member's merge weight keeps per version its pseudo-gradient is behind its island's newest "
        "member's (1: no discount; 0.5 gives back a one-round-late Δ that carries a failed round's steps the weight "
        "of one round). Measured with one learner 3x slower: after the merge that took its late Δ the loss was "
        "4-5 % lower than at 1, for two merges (docs/parity.md). Every peer of a swarm must use the same.")
    application: str = option(
        "delayed", "While a round is in flight, train on from the local model and rebase onto the merge when it "
        "lands (delayed), or from an estimate of the next global model (eager).", choices=APPLICATIONS)

    def __post_init__(self):
        _positive_float(self, "lr")
        if self.application not in APPLICATIONS:
            raise ConfigError(f"application must be one of {', '.join(APPLICATIONS)}, got {self.application!r}")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if not (isinstance(self.stale_factor, (int, float)) and 0.0 < self.stale_factor <= 1.0):
            raise ConfigError(f"stale factor must be in (0, 1], got {self.stale_factor!r}")
        for name in ("max_weight_ratio", "max_scale_ratio", "max_norm_ratio", "min_norm_ratio", "max_influence_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and (value == 0 or value >= 1)):
                raise ConfigError(f"{name.replace('_', ' ')} must be 0 (off) or a ratio >= 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    """How this peer meets others. Loopback and no NAT probing unless asked for."""

    run_id: str = option("p2pdiloco", "Swarm name; peers of a run share it.", group="connect")
    initial_peers: tuple[str, ...] = option(
        (), "Multiaddr of any live peer; repeat for several. None: start a new swarm.", metavar="MADDR",
        group="connect")
    listen: tuple[str, ...] = option(
        ("/ip4/127.0.0.1/tcp/0",), "Address to listen on; use /ip4/0.0.0.0/tcp/PORT to accept remote peers.",
        metavar="MADDR", group="connect")
    announce: tuple[str, ...] = option(
        (), "Public address others should dial (explicit port), e.g. /ip4/PUBLIC_IP/tcp/PORT.", metavar="MADDR",
        group="connect")
    swarm_key_file: Optional[Path] = option(
        None, "A file holding the swarm's shared secret: without it, no peer can use the swarm's DHT (to join, "
        "serve, fetch state or publish records). Or set P2PDILOCO_SWARM_KEY. Never logged.", group="connect")
    identity: Optional[Path] = option(
        None, "Private key file: keeps this peer's id stable across restarts (created if missing).",
        group="connect")
    nat_traversal: bool = option(False, "hivemind NAT port mapping, autonat and relays (they probe the real "
                                 "network).", group="connect")
    client_mode: bool = option(
        False, "For a peer nobody can dial (behind a NAT or firewall): it only dials out. It trains, contributes "
        "to rounds and fetches state as any peer; it never reduces a part of a round or serves its state.",
        group="connect")
    mode: str = option("decoupled", "decoupled: rounds run in the background; sync: everyone waits for everyone.",
                       choices=MODES)
    quorum: int = option(1, "Fewest members for a round to merge (1: a lone peer applies its own update).")
    max_island: int = option(16, "Largest all-reduce group.")
    grace_gamma: float = option(0.5, "γ of the adaptive grace window: γ·(τ·step − quorum − sync), from measured "
                                "averages.")
    overlap_steps: Optional[int] = option(
        None, "τ: inner steps a round may run in flight (default H: the next contribution is due then).")
    max_staleness: int = option(2, "Contribute from up to this many versions behind; further behind, catch up "
                                "first.")
    fragments: int = option(
        1, "Streaming DiLoCo: merge the model as this many fragments of about equal size, each in rounds of its own "
        "on a staggered schedule, so a round carries 1/P of the model (1: the whole model every round; "
        "docs/fragments.md).")
    fragments_in_flight: int = option(2, "τ of --fragments: at most this many fragments' rounds at once.")
    wait_for_newest: bool = option(
        False, "Decoupled mode: while peers on a newer global state train and none of them looks for an island, "
        "wait for them (up to 1.5 rounds) and join their island a version behind, rather than form an island that "
        "would fork the state. Simulated, on top of --wait-for-island: 2-30x fewer forks again, for 0-0.7 points of "
        "goodput in a swarm of 4 and 0.1-1.4 points with 16 learners (docs/architecture.md).")
    wait_for_island: bool = option(
        True, "Decoupled mode: while an island merges from our global state without us (its all-reduce began before "
        "we were ready), wait for it rather than form a second island that would fork the state; then join its "
        "members' next island a version behind, or take their state and let our update ride along. Simulated: "
        "1.7-80x fewer forks, at the same goodput in a swarm of 4 and half a point less with 16 learners "
        "(docs/architecture.md).")
    sync_wait: float = option(60.0, "Sync mode: longest wait at a round for peers still training, in seconds.")
    bandwidth_mbps: float = option(100.0, "Assumed link speed until the first round measures it (all-reduce "
                                   "deadlines).")
    upload_mbps: Optional[float] = option(
        None, "Cap what this peer's rounds send, in Mbit/s (its pushed codes and the sums it serves; one budget for "
        "all its fragments' rounds). With --fragments the rounds then spread over the time between them instead of "
        "bursting at the link's speed (docs/fragments.md). Default: no cap.")
    connect_timeout: float = option(20.0, "Seconds to wait for the initial peers before giving up.",
                                    group="connect")
    compression: str = option(
        "none", "Pseudo-gradients on the wire: integer codes on agreed block scales, packed and summed exactly by "
        "p2pdiloco's own streamed reduce-scatter: none (20-bit codes: each value within 2^-20 of its block's "
        "largest), int8, int4 or int2.",
        choices=COMPRESSIONS)
    error_feedback: Optional[bool] = option(
        None, "Carry what quantization dropped into the next contribution (default: on for int4, int2 and --topk).")
    error_feedback_decay: float = option(
        1.0, "Error feedback carries its residual times this (SparseLoCo's β, e.g. 0.95 with --outer-momentum 0: "
        "the decayed residual then stands in for the outer momentum).")
    topk: Optional[float] = option(
        None, "Send only this fraction of each block, the largest values (SparseLoCo-style; needs --compression, "
        "e.g. int2; error feedback carries the rest).")
    robust_merge: bool = option(
        True, "Each reducer also leaves out parts that point away from the others' (a cosine with their sum at or "
        "below 0, or under a quarter of the median). Measured with 4 peers (int4) and one liar whose claims are true "
        "of its lie: a sign-flipped Δ cost the honest peers 7.7 % without it and 0.5 % with it (at influence ratio "
        "1.5; 1.4 % at the defaults), at +0.2 % on clean runs (docs/hostile.md).")
    fault_plan: str = option("", "Test-only fault plan (p2pdiloco.faults).", hidden=True,
                             envvar="P2PDILOCO_FAULT_PLAN")

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
        _positive(self, "fragments", "fragments_in_flight")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"max staleness must be an integer >= 0, got {self.max_staleness!r}")
        if self.topk is not None and not (0 < self.topk < 1 and self.compression != "none"):
            raise ConfigError(f"--topk must be in (0, 1) and needs --compression int8|int4|int2, got {self.topk} "
                              f"with {self.compression}")
        if not (isinstance(self.error_feedback_decay, (int, float)) and 0 < self.error_feedback_decay <= 1):
            raise ConfigError(f"--error-feedback-decay must be in (0, 1], got {self.error_feedback_decay!r}")
        if self.client_mode and not self.initial_peers:
            raise ConfigError("--client-mode needs --initial-peers: a peer that nobody can dial cannot start a "
                              "swarm; join one through a peer that accepts connections")
        if self.quorum > self.max_island:
            raise ConfigError(f"quorum ({self.quorum}) cannot exceed max island size ({self.max_island})")
        _positive_float(self, "sync_wait", "bandwidth_mbps", "connect_timeout")
        if self.upload_mbps is not None:
            _positive_float(self, "upload_mbps")
        for addr in (*self.initial_peers, *self.listen, *self.announce):
            if not addr.startswith("/"):
                raise ConfigError(f"{addr!r} is not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...)")

    @property
    def link_mbps(self) -> float:
        """The link speed a round's deadlines assume until one is measured: a cap below the link is the link."""
        return min(self.bandwidth_mbps, self.upload_mbps or math.inf)


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """Everything one peer needs; built by the CLI from flags, a profile and defaults."""

    model: str = option(
        "small", f"A preset ({', '.join(MODEL_PRESETS)}: Llama shapes from ~1M to ~1B parameters, the vocabulary "
        "the tokenizer's), a config.json or Hugging Face model folder, or a hub id (loaded when online).")
    init_from: Optional[str] = option(
        None, "Start from these pretrained weights (a model folder or a hub id) instead of a seeded "
        "initialization; its config is the model's. Every peer of the run must give the same.")
    tokenizer: Optional[str] = option(
        None, "bytes, a tokenizer folder (p2pdiloco tokenizer train), or a hub id. Default: the prepared "
        "dataset's, or bytes for text.")
    data: tuple[str, ...] = option(
        (), "A dataset folder written by 'p2pdiloco data prepare' (read a window at a time), or a text file or folder of "
        "text files (tokenized in memory). Repeat with DIR:WEIGHT to mix prepared datasets by weight. Default: "
        "the built-in Shakespeare corpus.", metavar="PATH[:WEIGHT]")
    seed: int = option(0, "Initial weights (the same for every peer of a run).")
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    max_rounds: Optional[int] = option(None, "Leave after this many rounds.")
    max_time: Optional[float] = option(None, "Leave after this many seconds of training.")
    eval_batches: int = 8  # validation batches of the shared held-out split, per evaluation
    eval_every: int = option(1, "Evaluate after every N merged rounds (0: only at the end).")
    throttle: float = option(1.0, "Slow each inner step by this factor (emulates a slower machine).")
    threads: int = option(0, "torch threads (0: torch's default).")
    nice: int = option(0, "Train at this CPU niceness (0-19) once started (every rank of a member): the machine's "
                       "own work comes first, and a peer restarting beside others starts at full speed. The "
                       "swarm's helper processes, which serve the rounds, keep theirs, and take more CPU: five "
                       "peers sharing two cores trained a third fewer tokens at 10 (docs/simulator.md).")
    device: str = option("auto", "auto, cpu, cuda or cuda:N.")
    log_dir: Path = option(Path("runs/logs"), "Where logs, metrics (JSONL) and address files go.", group="connect")
    checkpoint_dir: Path = option(Path("runs/checkpoints"),
                                  "Checkpoints go to CHECKPOINT_DIR/RUN_ID/NAME; a restarted peer resumes from there.")
    checkpoint_every: int = option(5, "Merged rounds between checkpoints (one is always written on leaving; 0: "
                                   "never).")
    checkpoint_seconds: Optional[float] = option(
        None, "Also checkpoint this peer's own progress every this many seconds, at the next inner step, with a "
        "round in flight or not: a restart loses at most this much training. Default: every "
        f"{CHECKPOINT_FACTOR:g} times the last write's duration, {CHECKPOINT_FLOOR:g} s at least (the writes then "
        f"take under 2% of the time: a 88M model's 4 s write every 4 minutes, a small one's every "
        f"{CHECKPOINT_FLOOR:g} s), unless --checkpoint-every is 0; 0: only by "
        "--checkpoint-every. With --application eager, only between rounds (its steps in flight start from an "
        "estimate).")
    checkpoint_background: Optional[bool] = option(
        None, "Write checkpoints from a second thread: the training thread only copies θ and the inner optimizer's "
        "state to host memory (12 more bytes per parameter with AdamW, for the write's duration) and goes on. "
        "Default: on a GPU (the device keeps training while the host writes), off on a CPU, where the writer takes "
        "the cores the training uses (measured: no faster, docs/architecture.md) and the copy costs the memory.")
    keep_checkpoints: int = option(3, "How many checkpoints to keep.")
    global_state_on_disk: Optional[bool] = option(
        None, "Keep the global model and its outer momentum (8 bytes per parameter) in a file under "
        "CHECKPOINT_DIR/RUN_ID, in memory only while a round starts or ends, an evaluation, a checkpoint or a "
        "joiner reads them, and the round's averaging buffer (4 more) and error feedback's residual (4 more, where "
        "rounds use it) in others, paged in a piece at a time: the peak is then the inner loop's. Costs the disk "
        "12-20 bytes per parameter of writes per round; measured no slower (docs/hardware.md). Default: on where "
        "those 8 bytes per parameter would exceed a sixteenth of this machine's memory (a 1B model below 128 GB), "
        "except with --fragments.")
    name: Optional[str] = option(None, "Label for logs and metrics (default: end of the peer id).")
    metrics: str = option("", "Metrics sinks besides JSONL, comma-separated: tensorboard, wandb (each an optional "
                          "extra; W&B honours WANDB_MODE=offline).", metavar="SINKS")

    @property
    def metrics_sinks(self) -> tuple[str, ...]:
        return tuple(s.strip() for s in self.metrics.split(",") if s.strip())

    def __post_init__(self):
        if isinstance(self.data, (str, Path)):  # one path given in code rather than on the command line
            object.__setattr__(self, "data", (str(self.data),))
        check_model_source("--model", self.model)
        if self.init_from is not None:
            check_model_source("--init-from", self.init_from)
        unknown = [s for s in self.metrics_sinks if s not in METRICS_SINKS]
        if unknown:
            raise ConfigError(f"--metrics: unknown sink {unknown[0]!r}; choose from {', '.join(METRICS_SINKS)} "
                              f"(JSONL is always written)")
        for entry in self.data:
            path, _weight = data_entry(entry)
            if not path.exists():
                raise ConfigError(f"--data {path}: no such file or folder")
        for name in ("max_rounds", "max_time"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            raise ConfigError(f"nice must be an integer from 0 to 19, got {self.nice!r}")
        if self.throttle < 1.0 or not math.isfinite(self.throttle):
            raise ConfigError(f"throttle must be a finite factor >= 1, got {self.throttle}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _positive(self, "eval_batches")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint every must be an integer >= 0, got {self.checkpoint_every!r}")
        if self.checkpoint_seconds is not None and not (math.isfinite(self.checkpoint_seconds)
                                                        and self.checkpoint_seconds >= 0):
            raise ConfigError(f"checkpoint seconds must be a number >= 0, got {self.checkpoint_seconds!r}")
        _positive(self, "keep_checkpoints")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"eval every must be an integer >= 0, got {self.eval_every!r}")
        if self.swarm.fragments > 1:
            self._check_fragments()

    def _check_fragments(self) -> None:
        """What --fragments does not run with yet, each said in one line."""
        refused = [(self.inner.fsdp, "--fsdp"), (self.swarm.mode == "sync", "--mode sync"),
                   (self.inner.round_seconds is not None, "--round-seconds"),
                   (self.swarm.client_mode, "--client-mode"), (self.global_state_on_disk, "--global-state-on-disk"),
                   (self.outer.rda, "--rda")]
        for on, flag in refused:
            if on:
                raise ConfigError(f"--fragments {self.swarm.fragments} does not run with {flag} yet")
        if self.swarm.fragments > self.inner.steps:
            raise ConfigError(f"--fragments {self.swarm.fragments} is more than -H {self.inner.steps}: each "
                              "fragment's round would leave more often than once a step")

    def replace(self, **changes) -> "PeerConfig":
        return dataclasses.replace(self, **changes)

    def merge_settings(self, n_params: int, fingerprints: Optional[dict[str, str]] = None) -> dict[str, str]:
        """What every member of an island must share, published with our record and checked when others join: the
        model, its tokenizer and data (`fingerprints`: their hashes), the wire format, the merge rule and the outer
        step (members with another outer lr or momentum would each apply another Θ' to the same merged Δ: a fork
        at the first round)."""
        # a path or hub id may be long and differ between peers of one model: the config's hash says which model
        model = self.model if self.model in MODEL_PRESETS else "config"
        return dict(model=model, parameters=str(n_params), **(fingerprints or {}),
                    **merge_rule(self.swarm, self.outer))


def merge_rule(swarm: SwarmConfig, outer: OuterConfig) -> dict[str, str]:
    """The settings that say how an island merges: the wire format, the bounds and the outer step. Islands are
    looked for under a key made of them (p2pdiloco.swarm.wiring.island_prefix), so a node that only reduces
    parts finds a swarm's islands from what its peers publish."""
    on = {True: "on", False: "off"}
    return dict(compression=swarm.compression, topk="off" if swarm.topk is None else f"{swarm.topk:g}",
                weighting=outer.weighting, rda=on[outer.rda], outer_lr=f"{outer.lr:g}",
                outer_momentum=f"{outer.momentum:g}", max_weight_ratio=f"{outer.max_weight_ratio:g}",
                max_scale_ratio=f"{outer.max_scale_ratio:g}", max_norm_ratio=f"{outer.max_norm_ratio:g}",
                min_norm_ratio=f"{outer.min_norm_ratio:g}",
                stale_factor=f"{outer.stale_factor:g}", max_influence_ratio=f"{outer.max_influence_ratio:g}",
                robust_merge=on[swarm.robust_merge])


def data_entry(entry: str) -> tuple[Path, float]:
    """`PATH` or `PATH:WEIGHT` of --data (a path that itself holds a colon is taken whole when it exists)."""
    path, sep, weight = entry.rpartition(":")
    if not sep or Path(entry).exists():
        return Path(entry), 1.0
    try:
        value = float(weight)
    except ValueError:
        raise ConfigError(f"--data {entry}: the part after ':' must be a weight (a number)") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--data {entry}: a weight must be a positive number")
    return Path(path), value


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
