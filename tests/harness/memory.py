"""How far this process's resident memory peaked above where it stood, over a block of code: VmHWM, the peak,
reset to the present through /proc/self/clear_refs (Linux); the test is skipped where the kernel cannot. And a
fresh process to measure in, where what earlier tests freed (and the allocator kept) cannot serve or hide it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]  # where `p2pdiloco` and `tests` import from


def status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    open("/proc/self/clear_refs", "w").write("5")


class PeakGrowth:
    """`with PeakGrowth() as grew: ...`, then `grew.bytes`. Make it before the test's own set-up: a kernel that
    cannot reset the peak skips the test at once."""

    def __init__(self):
        try:
            _reset_peak()
        except OSError:
            pytest.skip("this kernel cannot reset a process's peak resident memory")
        self.bytes = None

    def __enter__(self) -> "PeakGrowth":
        _reset_peak()
        self._before = status_kb("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = (status_kb("VmHWM") - self._before) * 1024


def fresh_python(program: str, *args: str, env: dict | None = None) -> str:
    """Run `program` in a new Python process from the repository root, with `env` added to ours; its stdout."""
    return subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=120,
                          check=True, cwd=REPO, env={**os.environ, **(env or {})}).stdout
