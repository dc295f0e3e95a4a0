"""Who in a formed island is merged, and how much each counts: decided alike by every member from the
gathered records, so all of them encode with the same weights and agree on the same deadline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from p2pdiloco.core.outer import merge_weights
from p2pdiloco.protocol.remote import Island
from p2pdiloco.protocol.timing import agreed_deadline


@dataclass(frozen=True)
class IslandPlan:
    weights: Optional[list[float]]  # one per group member, 0 for the excluded; None: nothing to merge
    deadline: float  # the all-reduce deadline, seconds
    reason: str = ""  # why there is nothing to merge


def plan_island(island: Island, weighting: str, cap: float) -> IslandPlan:
    accepted = island.accepted
    deadline = agreed_deadline([m.budget for m in accepted], cap)
    if not accepted:
        return IslandPlan(None, deadline, "no member's record was well-formed")
    try:
        weights = iter(merge_weights([m.tokens for m in accepted], [m.steps for m in accepted], weighting))
    except ValueError as e:  # no tokens at all
        return IslandPlan(None, deadline, str(e))
    return IslandPlan([0.0 if m is None else next(weights) for m in island.members], deadline)
