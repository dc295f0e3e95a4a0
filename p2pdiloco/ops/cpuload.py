"""Where a host's CPU went during given time windows, sampled from /proc: how busy all cores were, how much of it
the kernel's soft interrupts took (packet forwarding, tbf, TCP), and the CPU each class of process used.

A benchmark on a few cores asks this to tell a slow transport from a starved one: an all-reduce that runs while
the cores are all busy measures the machine, not the protocol.

    with CpuSampler(classify) as cpu:
        ... run ...
    cpu.during([(t0, t1), ...])  # → {"busy": 0.97, "softirq": 0.21, "cores": {"trainers": 0.6, ...}}
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

HZ = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    comm: str
    cmdline: str
    ticks: int  # user + system CPU, in clock ticks
    started: int  # in ticks since boot: with the pid, names one process across samples


@dataclass
class Sample:
    time: float  # Unix time, the clock the peers' records use
    busy: int  # all cores, in ticks
    total: int
    softirq: int
    ticks: dict = field(default_factory=dict)  # (pid, started) → (class, ticks)


def read_host() -> tuple[int, int, int]:
    """(busy, total, softirq) ticks of all cores since boot; idle and iowait are idle."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # guest time is already counted in user
    return total - fields[3] - fields[4], total, fields[6]


def read_procs() -> list[Proc]:
    procs = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            proc = read_proc(int(entry.name))
            if proc is not None:
                procs.append(proc)
    return procs


def read_proc(pid: int) -> Optional[Proc]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone between the listing and the read
        return None
    comm = stat[stat.index("(") + 1:stat.rindex(")")]  # the name may hold spaces and parentheses
    rest = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
    return Proc(pid=pid, ppid=int(rest[1]), comm=comm, cmdline=cmdline.strip(), ticks=int(rest[11]) + int(rest[12]),
                started=int(rest[19]))


class CpuSampler:
    """Samples the host and every process each `interval` seconds on a thread; `classify(proc, by_pid)` names a
    process's class (None: not counted apart, still in the host's figures)."""

    def __init__(self, classify: Callable[[Proc, dict], Optional[str]], interval: float = 0.5):
        self.classify, self.interval = classify, interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append(self.sample())
            if self._stop.wait(self.interval):
                return

    def sample(self) -> Sample:
        busy, total, softirq = read_host()
        procs = read_procs()
        by_pid = {p.pid: p for p in procs}
        ticks = {}
        for p in procs:
            name = self.classify(p, by_pid)
            if name is not None:
                ticks[(p.pid, p.started)] = (name, p.ticks)
        return Sample(time.time(), busy, total, softirq, ticks)

    def during(self, windows: Iterable[tuple[float, float]]) -> dict:
        return cpu_during(self.samples, list(windows))


def cpu_during(samples: list[Sample], windows: list[tuple[float, float]]) -> dict:
    """The host's busy and soft-interrupt shares (of all cores) and each class's CPU in cores, over the sampling
    intervals whose midpoint falls in a window. A process that started within an interval counts from zero."""
    busy = total = softirq = 0
    classes: dict[str, int] = {}
    seconds = 0.0
    for before, after in zip(samples, samples[1:]):
        middle = (before.time + after.time) / 2
        if not any(start <= middle <= end for start, end in windows):
            continue
        busy, total = busy + after.busy - before.busy, total + after.total - before.total
        softirq += after.softirq - before.softirq
        seconds += after.time - before.time
        for key, (name, ticks) in after.ticks.items():
            earlier = before.ticks.get(key, (name, 0))[1]
            classes[name] = classes.get(name, 0) + ticks - earlier
    if not total:
        return {}
    return dict(seconds=round(seconds, 1), busy=busy / total, softirq=softirq / total,
                cores={name: ticks / HZ / seconds for name, ticks in sorted(classes.items())})
