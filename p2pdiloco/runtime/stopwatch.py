"""Where a start-up's seconds went, counted from the process's own start so that its imports count too."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional


def process_started() -> Optional[float]:
    """Unix time this process began (Linux: /proc), or None where that cannot be read."""
    try:
        # both since boot, to 1/100 s (/proc/stat's boot time is in whole seconds)
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Stopwatch:
    """Seconds per named phase, each from the end of the one before; the first from the process's start."""

    def __init__(self, since: Optional[float] = None):
        self.last = since if since is not None else (process_started() or time.time())
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + max(0.0, now - self.last), 3)
        self.last = now
