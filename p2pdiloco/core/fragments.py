"""Streaming DiLoCo's fragments (Douillard et al. 2025, arXiv 2501.18512): the model's parameters split into P
parts of about equal size, each merged by its own rounds on a staggered schedule, so that a round carries 1/P of
the model and the wire is busy all along instead of in one burst every H steps.

Pure: from the parameters' names and shapes to the parts of the flat vector (the layout every peer shares:
`training.inner.param_slices`) that each fragment holds. Every peer computes the same split from the same model;
`RULE` names the rule, so peers of one swarm can check they split alike.

The split packs tensors greedily (largest first, into the lightest fragment), as the paper does, with one change:
a tensor larger than half a fragment is first cut into blocks of whole rows. Packing whole tensors cannot
balance a model whose embedding matrix alone outweighs a fragment (the 135 M preset's is a fifth of the model: at
P = 8 the fragment holding it would be 1.7× the mean); rows keep a cut where a tensor's own structure has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

RULE = "rows-greedy-v1"  # the split's name: a peer that splits otherwise must not merge with us


@dataclass(frozen=True)
class Piece:
    """A run of whole rows of one tensor: elements [start, stop) of the tensor flattened, and of the flat vector
    [offset + start, offset + stop), where `offset` is the tensor's own start."""

    name: str
    index: int  # the tensor's position in the layout
    offset: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def flat(self) -> slice:
        return slice(self.offset + self.start, self.offset + self.stop)


@dataclass(frozen=True)
class Fragment:
    """One fragment: its pieces in layout order, so its own flat vector is the model's vector with the other
    fragments' elements left out."""

    index: int
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)

    def slices(self) -> Iterable[tuple[Piece, slice]]:
        """Each piece with its slice of this fragment's own flat vector."""
        at = 0
        for piece in self.pieces:
            yield piece, slice(at, at + piece.size)
            at += piece.size


def split(shapes: Sequence[tuple[str, Sequence[int]]], p: int) -> tuple[Fragment, ...]:
    """`shapes`: each tensor's name and shape in the layout's order. P fragments whose sizes differ by at most
    about a piece (half a fragment at worst; far less for a transformer's many equal blocks)."""
    if p < 1:
        raise ValueError(f"fragments: at least 1, not {p}")
    pieces = list(_pieces(shapes, _largest_piece(shapes, p)))
    if p > len(pieces):
        raise ValueError(f"fragments: {p} is more than the model's {len(pieces)} pieces")
    loads, held = [0] * p, [[] for _ in range(p)]
    for piece in sorted(pieces, key=lambda x: (-x.size, x.index, x.start)):
        lightest = min(range(p), key=lambda i: (loads[i], i))
        loads[lightest] += piece.size
        held[lightest].append(piece)
    return tuple(Fragment(i, tuple(sorted(h, key=lambda x: (x.index, x.start)))) for i, h in enumerate(held))


def _largest_piece(shapes: Sequence[tuple[str, Sequence[int]]], p: int) -> int:
    total = sum(math.prod(shape) for _, shape in shapes)
    return max(1, math.ceil(total / p / 2))


def _pieces(shapes: Sequence[tuple[str, Sequence[int]]], largest: int) -> Iterable[Piece]:
    offset = 0
    for index, (name, shape) in enumerate(shapes):
        numel = math.prod(shape)
        row = numel // shape[0] if len(shape) > 1 and shape[0] > 0 else 1
        blocks = max(1, math.ceil(numel / largest))
        rows = numel // row
        cuts = [row * (rows * b // blocks) for b in range(blocks)] + [numel]
        for start, stop in zip(cuts, cuts[1:]):
            if stop > start:
                yield Piece(name, index, offset, start, stop)
        offset += numel


def imbalance(fragments: Sequence[Fragment]) -> float:
    """The largest fragment over the mean."""
    sizes = [f.size for f in fragments]
    return max(sizes) / (sum(sizes) / len(sizes))


def fragment_overlap(h: int, fragments: int, in_flight: int) -> int:
    """τ of a fragment's grace window (Eq. 3), in inner steps: its round should end before the τ in flight hold the
    next ones back, τ·H/P steps after it left (with H, as for P = 1, rounds of 27 steps held fragments due every
    6). P = 1: H, the next contribution's due step."""
    return h if fragments == 1 else max(1, in_flight * h // fragments)


@dataclass(frozen=True)
class Stagger:
    """When each fragment's round leaves: fragment i every H steps, first after (i + 1)·H/P of them, so the P
    rounds of one period are spread evenly over it and the last fragment's rounds fall where P = 1's do.
    `in_flight`: at most this many fragments' rounds at once (τ); a fragment due while τ are out waits, and
    carries the extra steps when it goes."""

    fragments: int
    h: int
    in_flight: int = 2

    def __post_init__(self):
        if self.fragments < 1 or self.h < 1 or self.in_flight < 1:
            raise ValueError(f"stagger: fragments, H and in-flight must be at least 1, not "
                             f"{self.fragments}, {self.h}, {self.in_flight}")

    def first(self, i: int) -> int:
        """The step count at which fragment i is first due."""
        return max(1, round((i + 1) * self.h / self.fragments))

    def due(self, i: int, steps_since: int, sent_before: bool) -> bool:
        """Whether fragment i should leave, `steps_since` inner steps after its last round left (or after the
        start, if it has none)."""
        return self.overdue(i, steps_since, sent_before) >= 0

    def joins_early(self, steps_since: int) -> bool:
        """Whether a fragment whose peers are looking for an island for it now goes along before its own due step:
        with at least H/2 steps to give (a contribution of half a round), rather than miss their island. A peer
        restarted out of phase with the swarm otherwise looks for its own islands at its own steps, where nobody
        else is, round after round: a fragment's grace window (τ·H/P steps) is too short to bridge the gap, as
        P = 1's (H steps) is."""
        return self.fragments > 1 and steps_since >= self.h / 2

    def overdue(self, i: int, steps_since: int, sent_before: bool) -> int:
        """How many steps past due fragment i is (negative: not due yet)."""
        return steps_since - (self.h if sent_before else self.first(i))
