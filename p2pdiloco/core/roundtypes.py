"""The contract between the DiLoCo loop and whatever merges contributions (a swarm, or nobody)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class Contribution:
    delta: torch.Tensor  # pseudo-gradient Θ − θ, flat fp32
    tokens: int  # tokens processed since this peer's last merged contribution
    steps: int
    version: int  # global version Θ was at
    peer: str
    name: str
    digest: str  # hash of Θ
    seconds: float = 0.0  # wall time of the inner steps it covers (for goodput; never sent to peers)


@dataclass
class MergeOutcome:
    """What one round did with a contribution. `merged` is Σ wᵢΔᵢ over `members` (None: rolled back, nothing
    was merged). `state` is a global state downloaded from a peer; when set it already contains the merge (we
    were not on the group's newest state) and replaces ours; `state_before` was adopted before contributing."""

    merged: Optional[torch.Tensor]
    members: list[dict] = field(default_factory=list)  # gathered records: peer, name, version, tokens, ...
    weights: list[float] = field(default_factory=list)  # each member's merge weight (sums to 1)
    group_id: str = ""
    reason: str = ""
    seconds: float = 0.0  # ready → outcome
    quorum_seconds: float = 0.0  # ready → K−1 others ready
    sync_seconds: float = 0.0  # group formed → all-reduce returned
    deadline_seconds: float = 0.0  # the all-reduce deadline the group agreed on (from measured link speeds)
    allreduce_bytes_model: int = 0  # what the all-reduce layout says this peer sends (and receives)
    bytes_sent: Optional[int] = None  # measured: what our averager process wrote during the round (procio)
    bytes_received: Optional[int] = None
    state_before: Optional[tuple[dict, list[torch.Tensor]]] = None
    state: Optional[tuple[dict, list[torch.Tensor]]] = None
    stale: bool = False  # we were not on the group's newest state: the merge applies to theirs, not ours

    @property
    def committed(self) -> bool:
        return self.merged is not None

    @classmethod
    def failed(cls, reason: str, start: float, **kwargs) -> "MergeOutcome":
        return cls(merged=None, reason=reason, seconds=time.monotonic() - start, **kwargs)

    @classmethod
    def solo(cls, c: Contribution, start: float, **kwargs) -> "MergeOutcome":
        member = dict(peer=c.peer, name=c.name, version=c.version, tokens=c.tokens, steps=c.steps,
                      digest=c.digest)
        return cls(merged=c.delta.clone(), members=[member], weights=[1.0], reason="solo", seconds=time.monotonic() - start,
                   **kwargs)


def newest_member(members: list[dict]) -> dict:
    """The member whose global state the group's merge is applied to: the highest (version, digest), the
    same order every peer uses to reconcile forks (p2pdiloco.core.state.lineage_key)."""
    return max(members, key=lambda m: (int(m["version"]), str(m["digest"])))
