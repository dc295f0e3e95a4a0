"""Consensus distance without moving models: max ‖Θᵢ − Θⱼ‖ over live peers, from small published sketches.

Each peer publishes a k-dimensional random projection of its Θ (a sign-flipped block sum, seeded the same on
every peer), so ‖sketch(Θᵢ) − sketch(Θⱼ)‖ estimates ‖Θᵢ − Θⱼ‖ (unbiased in the square; ~1/√k relative
error). Peers whose state digests are equal are at distance exactly 0, which is the normal case.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

SKETCH_DIM = 64
_SEED = 0x5EED
_CHUNK = 1 << 20


def sketch(x: torch.Tensor, k: int = SKETCH_DIM) -> list[float]:
    """Σ over element i of sign(i)·x[i] into bucket i·k // n: linear in x, identical on every peer."""
    n = x.numel()
    out = torch.zeros(k, dtype=torch.float64)
    gen = torch.Generator().manual_seed(_SEED)
    for start in range(0, n, _CHUNK):
        chunk = x[start : start + _CHUNK].double()
        signs = torch.randint(0, 2, (chunk.numel(),), generator=gen, dtype=torch.int8).double() * 2 - 1
        index = torch.div(torch.arange(start, start + chunk.numel()) * k, n, rounding_mode="floor")
        out.index_add_(0, index, chunk * signs)
    return [float(v) for v in out]


def sketch_distance(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        return math.nan
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


def consensus_distance(states: Sequence[tuple[int, str, Sequence[float]]], same_version: bool = False) -> float:
    """Max pairwise distance among live peers' (version, digest, sketch); 0 exactly for equal digests.
    same_version=True measures disagreement only (forks): peers at different versions are merely at
    different points of the same history while rounds are in flight."""
    worst = 0.0
    for (va, digest_a, sketch_a), (vb, digest_b, sketch_b) in itertools.combinations(states, 2):
        if digest_a != digest_b and (va == vb or not same_version):
            worst = max(worst, sketch_distance(sketch_a, sketch_b))
    return worst
