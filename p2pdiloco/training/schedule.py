"""The inner learning rate of the whole swarm: a function of the swarm's progress, never of one peer's steps.

Progress is counted in tokens merged into the global model (`GlobalState.tokens`, carried with Θ to every
peer that takes it), so a peer that joins late trains at the swarm's learning rate, not at the start of a
warm-up of its own; plus this peer's own tokens not merged yet, times the tokens the swarm merged per token of
ours between our last two merges (`DiLoCo.schedule_tokens`): between merges the others train too, and the clock
runs as data-parallel's would over the whole swarm's batch.
"""

from __future__ import annotations

import math

from p2pdiloco.config import InnerConfig


def inner_lr(cfg: InnerConfig, tokens: int, tokens_per_step: int) -> float:
    """The learning rate at `tokens` of swarm progress: a linear warm-up over `warmup_steps` steps' worth of
    tokens, then constant, cosine or warmup-stable-decay to `min_lr_ratio` at `total_tokens`."""
    warmup = cfg.warmup_steps * tokens_per_step
    if tokens < warmup:  # the first step (tokens 0) takes 1/warmup_steps of the lr, as a step count would
        return cfg.lr * (tokens + tokens_per_step) / warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    floor = cfg.lr * cfg.min_lr_ratio
    total = cfg.total_tokens
    if cfg.lr_schedule == "cosine":
        done = min(1.0, max(0.0, (tokens - warmup) / max(1, total - warmup)))
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * done))
    decay_start = total * (1 - cfg.decay_fraction)  # wsd
    if tokens <= decay_start:
        return cfg.lr
    done = min(1.0, (tokens - decay_start) / max(1.0, total - decay_start))
    return cfg.lr + (floor - cfg.lr) * done
