"""Waiting on a future from a thread that may be asked to leave meanwhile."""

from __future__ import annotations

import time
from typing import Callable


class LeavingError(RuntimeError):
    pass


def result_unless_closed(future, timeout: float, closed: Callable[[], bool], poll: float = 0.25,
                         on_poll: Callable[[], None] = lambda: None):
    """`future.result(timeout)`, but raise LeavingError as soon as `closed()` says so: the peer is leaving, and an
    outcome that can no longer arrive (or a download of minutes) must not keep its process alive. `on_poll` runs
    every `poll` s while we wait. Cancelling the future is the caller's: only it knows what cancelling costs."""
    deadline = time.monotonic() + timeout
    while True:
        if closed():
            raise LeavingError("the peer is leaving")
        on_poll()
        try:
            return future.result(timeout=max(0.0, min(poll, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
