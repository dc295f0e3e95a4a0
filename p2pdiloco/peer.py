"""A peer, top to bottom: start (p2pdiloco.parts.startup) → train, rounds merging in the background → leave."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Optional

from p2pdiloco.config import PeerConfig
from p2pdiloco.parts.follower import run_follower
from p2pdiloco.parts.startup import start
from p2pdiloco.parts.streamed import start_streamed
from p2pdiloco.parts.workload import pick_device
from p2pdiloco.runtime.priority import train_at_niceness
from p2pdiloco.runtime.signals import on_stop_signals
from p2pdiloco.runtime.supervise import Life
from p2pdiloco.training.model import import_model_code
from p2pdiloco.training.ranks import follows_rank_0

__all__ = ["Peer", "pick_device", "run_peer"]
log = logging.getLogger("p2pdiloco")


class Peer:
    """The lifecycle, and the one thing a signal handler may touch: the stop."""

    def __init__(self, cfg: PeerConfig, life: Optional[Life] = None):
        self.cfg, self.life = cfg, life
        self.stop = threading.Event()

    def run(self) -> dict:
        since = self.life.began if self.life is not None else None  # a supervisor's first life: its imports too
        stay = (start_streamed if self.cfg.swarm.fragments > 1 else start)(self.cfg, self.stop, since)
        if self.life is not None:  # its supervisor counts it as a life that started
            self.life.trained()
        train_at_niceness(self.cfg.nice)
        try:
            return stay.train()
        finally:
            stay.close()

    def request_stop(self, *_args) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: leave at once
        log.info("stopping after the current step (Ctrl-C again to leave at once)")
        self.stop.set()


def log_file(cfg: PeerConfig) -> Optional[Path]:
    if not cfg.name:
        return None
    return cfg.log_dir / (f"{cfg.name}.log" if not follows_rank_0() else f"{cfg.name}-rank{os.environ['RANK']}.log")


def preload(cfg: PeerConfig) -> None:
    """Import what a peer's start would (this module did the rest): a supervisor forks its peers after this."""
    import_model_code(cfg.model)


def run_peer(cfg: PeerConfig, life: Optional[Life] = None) -> dict:
    """`life`: this process is one life of a supervised peer (`runtime.supervise`)."""
    if follows_rank_0():  # torchrun's other ranks of this member: they train beside rank 0, the peer
        return run_follower(cfg)
    peer = Peer(cfg, life)
    on_stop_signals(peer.request_stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr
    try:
        return peer.run()
    finally:
        # the peer has left (saved, reported): a SIGTERM that comes while the interpreter exits, from a launcher
        # stopping what it still sees running, would find the default action restored and kill a clean exit (seen
        # in CI: exit -15 after "done after 9 rounds"); an ignored signal stays ignored through the exit
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
