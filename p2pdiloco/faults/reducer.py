"""A hostile reducer (fault plan `hostile_reducer`, and the tests): the sum it serves is one its senders' claims
allow, so the sum check (p2pdiloco.core.claims.sum_why_not) passes it, but it is not the sum of what they sent:
the others' codes in its part are flipped. Its account of the part (p2pdiloco.core.audit) hides the difference
where `hide` says:
- `nowhere`: the account is of what it received, and does not add up to the sum;
- `own`: in its own share, whose norm then gives it away;
- `victim`: it flips only the first other sender's codes and states that sender's share as flipped: only that
  sender can tell."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2pdiloco.core import audit
from p2pdiloco.swarm.codes import Reduction

HIDING = ("nowhere", "own", "victim")


@dataclass
class BendingReduction(Reduction):
    hide: str = "own"

    def _sum(self, index: int) -> bytes:
        shares = self._shares(index)
        others = sorted(k for k in shares if k != audit.OWN)
        flipped = others[:1] if self.hide == "victim" else others
        honest = sum(shares.values())
        total = honest - 2 * sum((shares[k] for k in flipped), torch.zeros_like(honest))
        if self.hide == "own":
            shares = {**shares, audit.OWN: total - sum((shares[k] for k in others), torch.zeros_like(honest))}
        elif self.hide == "victim" and flipped:
            shares = {**shares, flipped[0]: -shares[flipped[0]]}
        return self._served(index, shares, total)
