"""Declarative fault plans for tests and chaos runs, read from P2PDILOCO_FAULTS (never set in normal use).

Format: comma-separated `action@version`:
- `die_in_allreduce@2`: SIGKILL this whole peer (main process and averager) shortly after the all-reduce of
  the round at global version 2 has started sending;
- `die_while_sharing@3`: SIGKILL this peer midway through the first state part it serves to a joiner while
  holding version ≥ 3 (a donor dies mid-transfer);
- `partition_until@3`: until this peer holds version 3, it looks for islands under a separate group key, so
  it can only meet peers with the same fault (two islands that form apart, on one DHT).
"""

from __future__ import annotations

import os

ENV = "P2PDILOCO_FAULTS"


def planned(action: str, version: int) -> bool:
    plan = os.environ.get(ENV, "")
    return f"{action}@{version}" in {item.strip() for item in plan.split(",") if item.strip()}


def version_of(action: str) -> int | None:
    """The version given for `action` in the plan, or None."""
    for item in os.environ.get(ENV, "").split(","):
        name, _, version = item.strip().partition("@")
        if name == action and version.isdigit():
            return int(version)
    return None
