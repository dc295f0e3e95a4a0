"""A fault of the global state: a peer that serves a state of its own, versions ahead of the one it holds."""

from __future__ import annotations

import torch

from p2pdiloco.core.exact import digest
from p2pdiloco.core.state import GlobalState
from p2pdiloco.faults.plan import FaultPlan
from p2pdiloco.training.diloco import DiLoCo, Settled


class FaultyDiLoCo(DiLoCo):
    """`hostile_ahead` (p2pdiloco.faults.plan): after every round it settles, the lie replaces its state."""

    def __init__(self, plan: FaultPlan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan

    def _settle(self) -> Settled:
        settled = super()._settle()
        if self.plan.due("hostile_ahead", self.state.version):
            lie_ahead(self.state)
        return settled


def lie_ahead(state: GlobalState) -> None:
    """Replace `state` with one of our own (Θ plus noise of Θ's spread), 5 versions ahead."""
    theta, momentum = state.outer.state_tensors()
    g = torch.Generator().manual_seed(state.version)
    lie = [theta + torch.randn(theta.shape, generator=g) * float(theta.std()), momentum.clone()]
    metadata = dict(version=state.version + 5, digest=digest(*lie), history=[list(k) for k in state.history])
    state.load(metadata, lie)
