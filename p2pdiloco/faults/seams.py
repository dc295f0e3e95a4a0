"""Which classes a peer is built from: the production ones, or the faulty subclasses a fault plan picks."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from p2pdiloco.faults.plan import FaultPlan
from p2pdiloco.swarm.averager import ExactAverager
from p2pdiloco.swarm.rounds import SwarmMerger
from p2pdiloco.training.diloco import DiLoCo


@dataclass(frozen=True)
class Seams:
    """The classes a peer is built from (each called with the production class's arguments)."""

    averager: Callable[..., ExactAverager] = ExactAverager
    merger: Callable[..., SwarmMerger] = SwarmMerger
    diloco: Callable[..., DiLoCo] = DiLoCo


def seams_for(plan: FaultPlan) -> Seams:
    if not plan:
        return Seams()
    from p2pdiloco.faults.averager import FaultyAverager
    from p2pdiloco.faults.merger import FaultyMerger
    from p2pdiloco.faults.state import FaultyDiLoCo

    return Seams(functools.partial(FaultyAverager, plan), functools.partial(FaultyMerger, plan),
                 functools.partial(FaultyDiLoCo, plan))
