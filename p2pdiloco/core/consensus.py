"""Consensus distance without moving models: max ‖Θᵢ − Θⱼ‖ over live peers, from small published sketches.

Each peer publishes a k-dimensional random projection of its Θ (a sign-flipped block sum, seeded the same on
every peer), so ‖sketch(Θᵢ) − sketch(Θⱼ)‖ estimates ‖Θᵢ − Θⱼ‖ (unbiased in the square; ~1/√k relative
error). Peers whose state digests are equal are at distance exactly 0, which is the normal case.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Iterable, Sequence

import torch

from p2pdiloco.runtime.paging import LetGo, hold

SKETCH_DIM = 64
MIN_SKETCH_DIM = 8
_SEED = 0x5EED
_CHUNK = 1 << 20
State = tuple[int, str, Sequence[float]]  # a peer's (version, digest, sketch), as its record publishes them


def sketch(x: torch.Tensor, k: int = SKETCH_DIM, let_go: LetGo = hold) -> list[float]:
    """Σ over element i of sign(i)·x[i] into bucket i·k // n: linear in x, identical on every peer. `let_go` is
    told each piece's elements once read, in order.

    The signs of a bucket's elements are one fixed draw of _CHUNK signs, repeated every _CHUNK elements of the
    bucket, so that a piece is one dot product with no random numbers drawn: a peer sketches Θ after every
    round on its training thread, and drawing a sign per element cost 20-25 ns an element (1.99 s at 100M
    parameters, one thread: scripts/bench/bench_round_thread.py; now 0.13 s). Within a bucket of up to _CHUNK
    elements (every bucket of a model under 64M parameters) the signs are independent, and the squared distance
    is unbiased as before."""
    n, signs = x.numel(), _signs()
    out = torch.zeros(k, dtype=torch.float64)
    for b in range(k):
        start, end = -(-b * n // k), -(-(b + 1) * n // k)  # the i with b ≤ i·k / n < b + 1
        for at in range(start, end, _CHUNK):
            piece = x[at : min(at + _CHUNK, end)]
            out[b] += torch.dot(piece.double(), signs[: piece.numel()])
            let_go(slice(at, at + piece.numel()))
    return [float(v) for v in out]


def sketch_dim(fragments: int) -> int:
    """The values of each fragment's sketch: a peer's P fragments share one budget of SKETCH_DIM, at least
    MIN_SKETCH_DIM each (a relative error of about 1/√k). Every sketch rides in the peer's one record, which each
    beat and each round's announcements store, and whose whole dictionary every replica answers a fetch or a store's
    search with: at P = 8, eight sketches of 64 were two thirds of a 2.9 KB record (docs/fragments.md)."""
    return max(MIN_SKETCH_DIM, SKETCH_DIM // max(1, fragments))


@functools.lru_cache(maxsize=1)
def _signs() -> torch.Tensor:
    """±1 in float64 (8 MB), drawn once from the seed every peer shares."""
    gen = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, 2, (_CHUNK,), generator=gen, dtype=torch.int8).double() * 2 - 1


def sketch_distance(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        return math.nan
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


def consensus_distance(states: Sequence[State]) -> float:
    """Max pairwise distance among live peers' (version, digest, sketch); 0 exactly for equal digests. Includes
    peers merely at different versions, i.e. at different points of one history while rounds are in flight."""
    worst = 0.0
    for (_, digest_a, sketch_a), (_, digest_b, sketch_b) in itertools.combinations(states, 2):
        if digest_a != digest_b:
            worst = max(worst, sketch_distance(sketch_a, sketch_b))
    return worst


def fork_distance(own: State, others: Sequence[State]) -> float:
    """Max distance from our state to other peers' states at our version with another digest: a fork we are part
    of. Others' forks among themselves are not ours to judge: their records may be seconds old (a killed peer's
    stays until it expires), so two stale records could show a fork that already healed."""
    version, digest, own_sketch = own
    return max((sketch_distance(own_sketch, s) for v, d, s in others if v == version and d != digest), default=0.0)


def forked_with(own: State, others: Iterable[tuple[str, State]]) -> list[str]:
    """The peers (by name) `fork_distance` measures against: at our version, with another digest. Pairs, not a
    mapping: a restarted peer's new record and its last life's, not yet expired, may share one name."""
    version, digest, _ = own
    return sorted({name for name, (v, d, _) in others if v == version and d != digest})
