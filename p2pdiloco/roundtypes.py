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


@dataclass
class MergeOutcome:
    merged: Optional[torch.Tensor]  # Σ wᵢΔᵢ over `members`; None: nothing to apply (rolled back)
    members: list[dict] = field(default_factory=list)  # gathered records: peer, name, version, tokens, ...
    group_id: str = ""
    reason: str = ""
    seconds: float = 0.0
    bytes_estimate: int = 0
    behind: bool = False  # peers are at a newer version: resync before the next round

    @property
    def committed(self) -> bool:
        return self.merged is not None

    @property
    def max_version(self) -> int:
        return max((m["version"] for m in self.members), default=-1)

    @classmethod
    def failed(cls, reason: str, start: float, behind: bool = False) -> "MergeOutcome":
        return cls(merged=None, reason=reason, seconds=time.monotonic() - start, behind=behind)

    @classmethod
    def solo(cls, c: Contribution, start: float) -> "MergeOutcome":
        member = dict(peer=c.peer, name=c.name, version=c.version, tokens=c.tokens, steps=c.steps)
        return cls(merged=c.delta.clone(), members=[member], reason="solo", seconds=time.monotonic() - start)
