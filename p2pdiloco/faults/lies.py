"""Liars whose claims are true of their lie (issue 51): each sends a pseudo-gradient of its choosing and claims
1000× the tokens it trained, with block maxima and norms measured on what it sends, so no check of codes against
claims can catch it; only the merge's bounds (p2pdiloco.protocol.island) and the robust merge's direction check
limit what it does. The fault plan's `hostile_claimed`, `hostile_flipped`, `hostile_noise`, `hostile_replay` and
`hostile_tiny` (p2pdiloco.faults.plan); the unit tests hold the bounds to the same lies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from p2pdiloco.protocol.remote import MAX_VERSION

CONSISTENT_LIES = ("hostile_claimed", "hostile_flipped", "hostile_noise", "hostile_replay", "hostile_tiny")
TOKENS_CLAIMED = 1000  # times what it trained: as much weight as the caps let it take


@dataclass
class Liar:
    action: str
    seed: int = 0
    replayed: Optional[torch.Tensor] = field(default=None, repr=False)  # hostile_replay: its first Δ, kept

    def __post_init__(self):
        if self.action not in CONSISTENT_LIES:
            raise ValueError(f"{self.action!r} is not one of {', '.join(CONSISTENT_LIES)}")
        self._generator = torch.Generator().manual_seed(self.seed)

    def lie(self, delta: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        """What it sends instead of `delta`, and the tokens it claims for it."""
        claimed = min(tokens * TOKENS_CLAIMED, MAX_VERSION)
        if self.action == "hostile_claimed":  # ×100 its Δ: the step's length
            return delta * 100, claimed
        if self.action == "hostile_flipped":  # against the others' direction, at a typical length
            return -delta, claimed
        if self.action == "hostile_noise":  # no direction at all, at a typical length
            noise = torch.randn(delta.shape, generator=self._generator, dtype=delta.dtype)
            return noise * (delta.norm() / noise.norm().clamp_min(1e-30)), claimed
        if self.action == "hostile_replay":  # the Δ of its first lying round, again and again
            if self.replayed is None or self.replayed.shape != delta.shape:
                self.replayed = delta.detach().clone()
            return self.replayed, claimed
        return delta * 1e-3, claimed  # hostile_tiny: next to nothing, to take weight from the others for free
