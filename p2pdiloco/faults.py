"""Declarative fault plans for tests and chaos runs, read from P2PDILOCO_FAULTS (never set in normal use).

Format: comma-separated `action@version`, e.g. `die_in_allreduce@2`: SIGKILL this whole peer (main process
and averager) shortly after the all-reduce of the round at global version 2 has started sending.
"""

from __future__ import annotations

import os

ENV = "P2PDILOCO_FAULTS"


def planned(action: str, version: int) -> bool:
    plan = os.environ.get(ENV, "")
    return f"{action}@{version}" in {item.strip() for item in plan.split(",") if item.strip()}
