"""The DiLoCo outer step, free of networking: pseudo-gradients, weighted merging and Nesterov SGD.

Every member of a round applies `OuterOptimizer.step` to the same inputs and must end bit-identical, on any
hardware. So each update is written as separate elementwise ops (each one correctly rounded in IEEE fp32)
rather than fused `add_(x, alpha=a)` forms, which some kernels compute with an FMA and some do not.
"""

from __future__ import annotations

from typing import Sequence

import torch

from p2pdiloco.config import WEIGHTINGS
from p2pdiloco.core.exact import chunks
from p2pdiloco.runtime.paging import LetGo, hold


def pseudo_gradient(global_params: torch.Tensor, local_params: torch.Tensor) -> torch.Tensor:
    """Δ = Θ − θ: points from the local model back to the global one, like a gradient."""
    return global_params - local_params


def merge_weights(tokens: Sequence[float], steps: Sequence[float] | None = None,
                  weighting: str = "tokens") -> list[float]:
    """Normalised merge weights for one round's contributions.

    tokens2:  tokens²/steps (Decoupled DiLoCo): quantity (tokens since the last merge) times quality
              (tokens per step, i.e. batch size); a peer that trained longer or on bigger batches counts more.
    tokens:   proportional to tokens processed.
    uniform:  every contribution counts the same (OpenDiLoCo).
    """
    if weighting == "tokens2":
        if steps is None or len(steps) != len(tokens):
            raise ValueError("tokens² / steps weighting needs the steps of every contribution")
        raw = [float(t) * float(t) / float(s) if s > 0 else 0.0 for t, s in zip(tokens, steps)]
    elif weighting == "tokens":
        raw = [float(t) for t in tokens]
    elif weighting == "uniform":
        raw = [1.0 if t > 0 else 0.0 for t in tokens]
    else:
        raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
    total = sum(raw)
    if total <= 0:
        raise ValueError("cannot merge contributions that processed no tokens")
    return [r / total for r in raw]


def weighted_merge(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Reference (in-process) weighted sum of pseudo-gradients; the swarm computes the same thing."""
    merged = torch.zeros_like(deltas[0], dtype=torch.float64)
    for delta, weight in zip(deltas, weights):
        merged += delta.double() * weight
    return merged.float()


# ---- radial-directional averaging (RDA) ----------------------------------------------------------------
# Learners' pseudo-gradients are nearly orthogonal, so a plain mean of M of them shrinks like 1/√M and the
# outer lr would need retuning whenever the island size changes. RDA averages norms and directions apart:
#   RDA = (Σ w‖v‖) · unit(Σ w·unit(v))          (weights normalised; embeddings keep the plain mean)
# In the swarm each member sends w·unit(v) through the exact sum and its norms through the gathered
# metadata; every member then rescales the summed directions identically.

Segment = tuple[int, int]  # [start, end) of one tensor inside the flat parameter vector


def _stable(x: float) -> float:
    """Round a float64 reduction to 12 significant digits, so members whose BLAS sums in another order still
    derive the same fp32 scale (bitwise agreement across hardware)."""
    return float(f"{x:.12e}")


def segment_norm(x: torch.Tensor) -> float:
    return _stable(float(torch.sum(x.double() * x.double())) ** 0.5)


def rda_directions(delta: torch.Tensor, segments: Sequence[Segment]) -> tuple[torch.Tensor, list[float]]:
    """Unit directions on the RDA segments (the rest untouched) and the norm of each segment."""
    out = delta.clone()
    norms = []
    for start, end in segments:
        norm = segment_norm(delta[start:end])
        norms.append(norm)
        if norm > 0:
            out[start:end] = delta[start:end] / torch.tensor(norm, dtype=torch.float32)
    return out, norms


def rda_combine(summed: torch.Tensor, norms: Sequence[Sequence[float]], weights: Sequence[float],
                segments: Sequence[Segment]) -> torch.Tensor:
    """Turn Σ w·unit(v) into the RDA update: mean norm times the unit of the summed direction."""
    out = summed.clone()
    for k, (start, end) in enumerate(segments):
        mean_norm = _stable(sum(w * member[k] for w, member in zip(weights, norms)))
        direction_norm = segment_norm(summed[start:end])
        scale = _stable(mean_norm / direction_norm) if direction_norm > 0 else 0.0
        out[start:end] = summed[start:end] * torch.tensor(scale, dtype=torch.float32)
    return out


def rda_reference(deltas: Sequence[torch.Tensor], weights: Sequence[float],
                  segments: Sequence[Segment]) -> torch.Tensor:
    """In-process RDA of whole pseudo-gradients (tests and the single-process simulator)."""
    units, norms = zip(*(rda_directions(d, segments) for d in deltas))
    return rda_combine(weighted_merge(units, weights), norms, weights, segments)


def solo_scale(island_sizes: Sequence[int]) -> float:
    """What a lone member's Δ is scaled by in its solo merge, where the state's latest merges (`island_sizes`:
    members each) merged up to k members: 1/k, as if the k − 1 absent members had sent Δ = 0. The outer lr and
    momentum were tuned on merges of k members' tokens, and a lone Δ carries 1/k of them and all of one member's
    noise. Measured in the three-peer swarm test (int4, H = 15; docs/parity.md), a solo merge after three-member
    ones raised the merged model's validation loss in 3 runs of 3 (+3.3 to +6.4 %; once +13 % in CI); at 1/√3
    it still rose in 2 runs of 6 (to +3.2 %); at 1/3 it moved −1.4 to +0.2 % in 9 runs. A peer alone for all the
    latest merges steps at 1, as a learner alone always did. Only solo merges are scaled: an island's members
    must derive bit-equal steps, and the merges list is not part of the state's digest."""
    return 1.0 / max(1, max(island_sizes, default=1))


STEP_CHUNK = 1 << 20  # elements per slice of the outer step (4 MB temporaries)


class OuterOptimizer:
    """Nesterov SGD on a flat fp32 parameter vector: buf ← μ·buf + Δ ;  Θ ← Θ − lr·(Δ + μ·buf)."""

    def __init__(self, params: torch.Tensor, lr: float, momentum: float,
                 momentum_buffer: torch.Tensor | None = None):
        """Steps `params` in place; `momentum_buffer` (zeros, params' size) where the caller wants it kept."""
        self.params = params
        self.lr, self.momentum = lr, momentum
        self.momentum_buffer = torch.zeros_like(params) if momentum_buffer is None else momentum_buffer

    @torch.no_grad()
    def step(self, merged_delta: torch.Tensor, let_go: LetGo = hold, scale: float = 1.0) -> None:
        """A chunk at a time: elementwise, so the same bits, with a chunk's temporaries, not a model's. `done` is
        told each chunk finished (a parked state pages it out). `scale`: Δ's (solo_scale)."""
        mu = torch.tensor(self.momentum, dtype=torch.float32)
        lr = torch.tensor(self.lr, dtype=torch.float32)
        for part in chunks(self.params.numel(), STEP_CHUNK):
            buffer, delta = self.momentum_buffer[part], _scaled(merged_delta[part], scale)
            buffer.mul_(mu).add_(delta)
            update = torch.mul(buffer, mu).add_(delta)
            self.params[part].sub_(update.mul_(lr))
            let_go(part)

    @torch.no_grad()
    def moves(self, merged_delta: torch.Tensor, let_go: LetGo = hold, scale: float = 1.0
              ) -> tuple[float, float]:
        """How far `step(merged_delta, scale=scale)` would move Θ and the momentum (L2 norms), leaving both
        untouched; a chunk at a time, `done` told each chunk read."""
        mu = torch.tensor(self.momentum, dtype=torch.float32)
        lr = torch.tensor(self.lr, dtype=torch.float32)
        theta = momentum = 0.0
        for part in chunks(self.params.numel(), STEP_CHUNK // 4):  # a 1 MB temporary: the round's peak stays put
            buffer, delta = self.momentum_buffer[part], _scaled(merged_delta[part], scale)
            work = torch.mul(buffer, mu - 1).add_(delta)  # m' − m
            momentum += float(torch.linalg.vector_norm(work)) ** 2
            work.add_(buffer).mul_(mu).add_(delta).mul_(lr)  # lr·(Δ + μ·m'), the step
            theta += float(torch.linalg.vector_norm(work)) ** 2
            let_go(part)
        return theta ** 0.5, momentum ** 0.5

    @torch.no_grad()
    def lookahead(self, delta: torch.Tensor) -> torch.Tensor:
        """The Θ that `step(delta)` would produce, leaving Θ and the momentum untouched (eager updates)."""
        mu = torch.tensor(self.momentum, dtype=torch.float32)
        lr = torch.tensor(self.lr, dtype=torch.float32)
        buffer = torch.mul(self.momentum_buffer, mu).add_(delta)
        return self.params - torch.mul(buffer, mu).add_(delta).mul_(lr)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.params, self.momentum_buffer]

    def load_state_tensors(self, params: torch.Tensor, momentum_buffer: torch.Tensor) -> None:
        self.params.copy_(params)
        self.momentum_buffer.copy_(momentum_buffer)


def _scaled(delta: torch.Tensor, scale: float) -> torch.Tensor:
    return delta if scale == 1.0 else torch.mul(delta, torch.tensor(scale, dtype=torch.float32))
