"""An island's arithmetic, the same wherever it runs: what each member sends of its pseudo-gradient (its block
statistics and codes) and how an exact sum of codes becomes the merged update. The averager runs it a piece at a
time over libp2p streams (p2pdiloco.swarm.island_rounds); the simulator's learners run it in one process
(p2pdiloco.sim.learners). Codes, top-k selection and scales are per block, so a piece's bits are the whole
vector's there, and both give every member the same merged update, bit for bit."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from p2pdiloco.core import codec
from p2pdiloco.core.claims import block_norms
from p2pdiloco.protocol.island import IslandPlan
from p2pdiloco.protocol.remote import Member


def wire_format(bits: int, topk: float, group_size: int) -> codec.DenseFormat:
    """How `group_size` senders' codes travel: every element, or the top-k fraction of each block."""
    if topk:
        return codec.TopKFormat(bits, group_size, topk)
    return codec.DenseFormat(bits, group_size)


class BodyStatistics:
    """What our gathered record says of what we send, per block: the statistic the wire format agrees its scales
    from (the block maximum, but for int2) and the block norms that bound what our codes may hold
    (p2pdiloco.core.claims). Per block, so a pass can add them a chunk of whole blocks at a time, with the same
    bits as over the whole vector, and let each chunk of the buffer go once done."""

    def __init__(self, n: int, fmt: codec.DenseFormat):
        self.wire_format = fmt
        self.statistic = torch.empty(codec.n_blocks(n), dtype=torch.float32)
        self.norms = torch.empty(codec.n_blocks(n), dtype=torch.float32)

    def add(self, piece: torch.Tensor, blocks: slice) -> None:
        """`piece`: whole blocks `blocks` of the vector (the last may be short: the vector's own end)."""
        self.statistic[blocks] = self.wire_format.block_statistic(piece)
        self.norms[blocks] = block_norms(piece)

    @classmethod
    def of(cls, body: torch.Tensor, fmt: codec.DenseFormat) -> "BodyStatistics":
        statistics = cls(body.numel(), fmt)
        statistics.add(body, slice(0, None))
        return statistics


def group_scales(plan: IslandPlan, bits: int) -> torch.Tensor:
    """The block scales every included member encodes on: from their clipped statistics, each times its weight."""
    return codec.agreed_scales([plan.maxabs[i].double() * plan.weights[i] for i in plan.included], bits)


def encode_piece(delta: torch.Tensor, weight: float, scales: torch.Tensor, bits: int, fmt, start: int,
                 end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our codes of [start, end), a block-aligned piece: the same bits as the whole vector's codes there."""
    first = start // codec.BLOCK
    enc = codec.encode(delta[start:end], weight, scales[first:first + codec.n_blocks(end - start)], bits, fmt,
                       with_sent=False)
    return enc.codes, enc.selected


def land_piece(merged: torch.Tensor, scales: torch.Tensor, weights: Mapping[str, float], start: int, end: int,
               total: torch.Tensor, left_out: frozenset) -> None:
    """One piece's exact sum of codes, dequantized into `merged` and scaled back to a weighted mean if its
    reducer left senders out. Pieces start on block boundaries."""
    first = start // codec.BLOCK
    codec.dequantize(total, scales[first:first + codec.n_blocks(end - start)], out=merged[start:end])
    reweigh(merged[start:end], left_out, weights)


def reweigh(piece: torch.Tensor, left_out: frozenset, weights: Mapping[str, float]) -> None:
    """A piece some senders were left out of sums the others' weights only: scale it back to the weights' total
    (1, but where stale members were discounted: p2pdiloco.protocol.island). The names come from the piece's
    reducer, the same for every member, so every member gets the same bits."""
    kept = sum(w for peer, w in weights.items() if peer not in left_out)  # dict order: the group's, everywhere
    if left_out and kept > 0:
        piece.mul_(torch.tensor(sum(weights.values()) / kept, dtype=torch.float32))


def merged_in_one_place(bodies: Sequence[torch.Tensor], members: Sequence[Member], plan: IslandPlan, bits: int,
                        fmt: codec.DenseFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ wᵢΔᵢ of the plan's included members, as the averager's reduce-scatter and all-gather make it (one
    exact integer sum of everyone's codes, decoded once), and the scales it was made on. `bodies[i]`: member
    i's compensated contribution."""
    scales = group_scales(plan, bits)
    n = bodies[plan.included[0]].numel()
    total = torch.zeros(n, dtype=torch.int64)
    for i in plan.included:
        codes, _ = encode_piece(bodies[i], plan.weights[i], scales, bits, fmt, 0, n)
        total += codes
    merged = torch.empty(n, dtype=torch.float32)
    weights = {members[i].peer: plan.weights[i] for i in plan.included}
    land_piece(merged, scales, weights, 0, n, total, frozenset())
    return merged, scales
