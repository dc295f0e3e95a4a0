"""Test-only faults, from outside: a fault plan (`plan`) picks subclasses of the production classes that lie, slow
down or die on cue, the way hivemind's own tests subclass its averager. The wiring asks `seams.seams_for` which
classes to build; with no plan it gets the production classes themselves, and no production module names a
fault."""

from p2pdiloco.faults.plan import NO_FAULTS, FaultPlan, FaultPlanError  # light: the CLI checks a plan early

__all__ = ["NO_FAULTS", "FaultPlan", "FaultPlanError"]
