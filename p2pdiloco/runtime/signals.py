"""Stop signals for a process that forks helpers (hivemind's DHT and averager processes fork from it).

A forked process inherits Python's signal handlers. A handler that only sets an event would then make a helper
ignore SIGTERM, and hivemind's way to end a helper whose shutdown overran is exactly a SIGTERM (`terminate()`):
the helper lived on, and the peer or node, joining it at exit, never exited (seen with `bootstrap --reduce` on a
loaded machine).
"""

from __future__ import annotations

import os
import signal
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signals(handler: Callable) -> None:
    """SIGINT and SIGTERM call `handler(signum, frame)` in this process only; in a process forked from it they
    do what they do by default."""
    owner = os.getpid()

    def handle(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        handler(signum, frame)

    for signum in STOP_SIGNALS:
        signal.signal(signum, handle)
