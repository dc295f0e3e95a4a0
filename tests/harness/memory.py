"""How far this process's resident memory peaked above where it stood, over a block of code: VmHWM, the peak,
reset to the present through /proc/self/clear_refs (Linux); the test is skipped where the kernel cannot."""

from __future__ import annotations

import pytest


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
