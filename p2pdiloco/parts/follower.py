"""A rank other than 0 of a member of several ranks (torchrun): no helpers, no Θ, no checkpoints of its own. It
trains beside rank 0 in lockstep (`training.ranks`) until rank 0 leaves."""

from __future__ import annotations

import logging
import signal

from p2pdiloco.config import PeerConfig
from p2pdiloco.parts.workload import member_stream, prepare
from p2pdiloco.runtime.priority import train_at_niceness
from p2pdiloco.training.inner import InnerTrainer
from p2pdiloco.training.model import build_model
from p2pdiloco.training.ranks import follow, ranks_from_env

log = logging.getLogger("p2pdiloco")


def run_follower(cfg: PeerConfig) -> dict:
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 leads the leave, then lets us go
        signal.signal(sig, signal.SIG_IGN)
    workload = prepare(cfg)
    ranks = ranks_from_env(workload.device)
    model = build_model(workload.model_config, cfg.seed, cfg.init_from).to(workload.device)
    # the stream's seed, θ and the optimizer's state come from rank 0 before the first step
    trainer = InnerTrainer(model, member_stream(cfg, workload, 0, ranks), cfg.inner, workload.device, cfg.throttle,
                           ranks)
    train_at_niceness(cfg.nice)  # as rank 0 does: ranks in lockstep at one priority
    steps = follow(trainer)
    log.info("rank %d of %d: trained %d steps beside rank 0, which has left", ranks.rank, ranks.world, steps)
    return dict(rank=ranks.rank, steps=steps)
