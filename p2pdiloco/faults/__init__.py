"""Test-only faults, from outside: a fault plan (`plan`) picks subclasses of the production classes that lie, slow
down or die on cue, the way hivemind's own tests subclass its averager. The wiring asks `seams_for` which classes to
build; with no plan it gets the production classes themselves, and no production module names a fault."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from p2pdiloco.faults.plan import NO_FAULTS, FaultPlan, FaultPlanError
from p2pdiloco.swarm.averager import ExactAverager
from p2pdiloco.swarm.rounds import SwarmMerger
from p2pdiloco.training.diloco import DiLoCo

__all__ = ["NO_FAULTS", "FaultPlan", "FaultPlanError", "Seams", "seams_for"]


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
