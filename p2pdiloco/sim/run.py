"""Run one mode, or sweep one parameter over every mode."""

from __future__ import annotations

import dataclasses

from p2pdiloco.sim.baselines import SimResult, simulate_dp, simulate_elastic, simulate_sync_diloco
from p2pdiloco.sim.central import simulate_central
from p2pdiloco.sim.decoupled import simulate_decoupled
from p2pdiloco.sim.failures import draw
from p2pdiloco.sim.params import MODES, SimParams

_RUN = {"dp": simulate_dp, "elastic": simulate_elastic, "sync-diloco": simulate_sync_diloco,
        "decoupled": simulate_decoupled, "central": simulate_central}


def simulate(p: SimParams, mode: str) -> SimResult:
    if mode not in _RUN:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    return _RUN[mode](p, draw(p))


def sweep(p: SimParams, modes, **axis) -> list[SimResult]:
    """One result per mode and per value of the one parameter in `axis` (e.g. learners=[2, 4, 8])."""
    (name, values), = axis.items()
    return [simulate(dataclasses.replace(p, **{name: v}), mode) for v in values for mode in modes]
