"""Bytes a process moved through its sockets and pipes, as the kernel counts them (Linux /proc/PID/io).

Used to measure what one round really sent and received: hivemind's averager runs in a child process that
does nothing else during a round, handing every tensor part to the libp2p daemon through a socket and
reading the others' parts back, so the change of its counters over the round is the round's traffic as
seen by this peer (before libp2p's own framing and encryption).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class IoCounters:
    read: int  # rchar: bytes returned by read-like system calls
    written: int  # wchar: bytes passed to write-like system calls

    def __sub__(self, other: "IoCounters") -> "IoCounters":
        return IoCounters(self.read - other.read, self.written - other.written)


def io_counters(pid: Optional[int]) -> Optional[IoCounters]:
    """The process's counters, or None where they cannot be read (not Linux, gone, no permission)."""
    if pid is None:
        return None
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return IoCounters(read=int(fields["rchar"]), written=int(fields["wchar"]))
    except (OSError, KeyError, ValueError):
        return None


def moved_since(pid: Optional[int], before: Optional[IoCounters]) -> Optional[IoCounters]:
    after = io_counters(pid)
    return None if before is None or after is None else after - before
