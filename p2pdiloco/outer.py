"""The DiLoCo outer step, free of networking: pseudo-gradients, weighted merging and Nesterov SGD.

Every member of a round applies `OuterOptimizer.step` to the same inputs and must end bit-identical, on any
hardware. So each update is written as separate elementwise ops (each one correctly rounded in IEEE fp32)
rather than fused `add_(x, alpha=a)` forms, which some kernels compute with an FMA and some do not.
"""

from __future__ import annotations

from typing import Sequence

import torch


def pseudo_gradient(global_params: torch.Tensor, local_params: torch.Tensor) -> torch.Tensor:
    """Δ = Θ − θ: points from the local model back to the global one, like a gradient."""
    return global_params - local_params


def merge_weights(tokens: Sequence[float]) -> list[float]:
    """Normalised merge weights, proportional to the tokens each contribution processed."""
    total = float(sum(tokens))
    if total <= 0:
        raise ValueError("cannot merge contributions that processed no tokens")
    return [float(t) / total for t in tokens]


def weighted_merge(deltas: Sequence[torch.Tensor], tokens: Sequence[float]) -> torch.Tensor:
    """Reference (in-process) token-weighted mean of pseudo-gradients; the swarm computes the same thing."""
    weights = merge_weights(tokens)
    merged = torch.zeros_like(deltas[0], dtype=torch.float64)
    for delta, weight in zip(deltas, weights):
        merged += delta.double() * weight
    return merged.float()


class OuterOptimizer:
    """Nesterov SGD on a flat fp32 parameter vector: buf ← μ·buf + Δ ;  Θ ← Θ − lr·(Δ + μ·buf)."""

    def __init__(self, params: torch.Tensor, lr: float, momentum: float):
        self.params = params
        self.lr, self.momentum = lr, momentum
        self.momentum_buffer = torch.zeros_like(params)

    @torch.no_grad()
    def step(self, merged_delta: torch.Tensor) -> None:
        mu = torch.tensor(self.momentum, dtype=torch.float32)
        lr = torch.tensor(self.lr, dtype=torch.float32)
        self.momentum_buffer.mul_(mu).add_(merged_delta)
        update = torch.mul(self.momentum_buffer, mu).add_(merged_delta)
        self.params.sub_(update.mul_(lr))

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.params, self.momentum_buffer]

    def load_state_tensors(self, params: torch.Tensor, momentum_buffer: torch.Tensor) -> None:
        self.params.copy_(params)
        self.momentum_buffer.copy_(momentum_buffer)
