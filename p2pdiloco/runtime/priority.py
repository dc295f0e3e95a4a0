"""The training process's CPU priority (`join --nice`).

A peer's start-up (imports, its helpers, loading a checkpoint) runs at the priority it was started with, and its
inner steps at a lower one: the machine's owner keeps a responsive machine, and where peers share cores (a
chaos run; several peers on one box) a restarted peer's start-up is not slowed by those already training.

On Linux a niceness belongs to a thread, and a thread starts with its creator's: every thread of this process is
reniced, so torch's worker threads, started before, are too, and the threads started after inherit it. The
helper processes (the DHT, the averagers) were forked earlier and keep theirs: they serve the rounds that other
peers wait on.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("p2pdiloco")


def threads_of_this_process() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc (not Linux): the process's priority is its threads'
        return [0]


def train_at_niceness(nice: int) -> None:
    """Raise every thread of this process to niceness `nice` (never lower it: that needs privileges)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    for tid in threads_of_this_process():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # the thread has ended since it was listed
            continue
    log.info("training at niceness %d", nice)
