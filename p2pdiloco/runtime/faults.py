"""Declarative fault plans for tests and chaos runs, read from P2PDILOCO_FAULTS (never set in normal use).

Format: comma-separated `action@version`, optionally `action@version:PEER_ID:PEER_ID...` to aim the fault at
the requests of those peers only:
- `die_in_allreduce@2`: SIGKILL this whole peer (main process and averager) shortly after the all-reduce of
  the round at global version 2 has started sending;
- `die_while_sharing@3`: SIGKILL this peer while a request for a part of its state at version ≥ 3 is in
  flight; aimed at peers, it serves their first such part, then dies on their second (a donor dies
  mid-transfer, after the joiner got some parts from it);
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
    for name, version, _ in _items():
        if name == action and version.isdigit():
            return int(version)
    return None


def targets_of(action: str) -> frozenset[str]:
    """The peer ids `action` is aimed at; empty: any peer."""
    for name, _, targets in _items():
        if name == action:
            return targets
    return frozenset()


def _items():
    for item in os.environ.get(ENV, "").split(","):
        name, _, rest = item.strip().partition("@")
        version, *targets = rest.split(":")
        yield name, version, frozenset(t for t in targets if t)
