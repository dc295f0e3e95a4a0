"""What a member's codes may hold, from what it claimed: whoever reduces a part checks every sender against it.

At matchmaking each member gathers two statistics per block of its pseudo-gradient: the block maximum (the
group's scales come from it) and the block's L2 norm. The island bounds the claims (p2pdiloco.protocol.island:
maxima clipped to a multiple of the median, weights cut where a claimed norm stands out), and then the codes a
member sends must stay within what it claimed, in code units:
- every code in a block whose maximum the island did not clip is within round(w·max / scale): an honest member's
  codes are round(w·Δ / scale) of values at most its maximum, and rounding is monotone, so this bound is exact;
  where the maximum was clipped (or the statistic is not a maximum), only the codec's ±L applies;
- the norm of the codes over any run of blocks is within ‖w·norm / scale‖ of those blocks plus what rounding can
  add: 1/2 per nonzero code;
- and, on dense formats that agree their scales from maxima, at least ‖f·w·norm / scale‖ over the blocks, less
  what rounding can take (1/2 per value), where f is the block's backing: 1, or where its maximum m was clipped to
  c, c / m. An honest member's values v = w·Δ / scale are at most L / f in a clipped block (the scale holds w·c
  within L), and clamping a value at most L / f to ±L keeps at least f of it; unclipped, they are never clamped. So
  its codes meet the floor; a member that claims a typical norm and sends a near-zero Δ, to take weight for free
  (p2pdiloco.protocol.island.cut_below_median_norm), does not, and one that claims huge maxima to lower its floor
  lowers the norm the island's weights count it by as much (island.backed_norms).
So a liar that claims honest statistics and sends a scaled or random Δ breaks one of the two, and one that claims
huge statistics is bounded by the island: its maxima clipped, its weight cut. Neither needs any other member's
part, so a reducer decides each sender alone, and a member whose Δ differs from the others' many-fold (a veteran
beside a fresh joiner) is bounded, never refused.

Pure tensor code: no network, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from p2pdiloco.core.exact import BLOCK, blocked, blockwise, n_blocks

NORM_SLACK = 1e-4  # relative: a claimed norm is rounded to fp32 once, and sums of squares round on the way


def block_norms(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each block (fp32, rounded up from float64 so a claim is never below the truth)."""
    out = torch.empty(n_blocks(x.numel()), dtype=torch.float32)
    for part, blocks in blockwise(x.numel()):
        norms = blocked(x[part].double()).square_().sum(dim=1).sqrt_()
        out[blocks] = _round_up_to_fp32(norms)
    return out


def _round_up_to_fp32(x: torch.Tensor) -> torch.Tensor:
    down = x.float()
    return torch.where(down.double() < x, torch.nextafter(down, torch.tensor(math.inf)), down)


@dataclass(frozen=True)
class Claims:
    """One sender's bounds in code units, per block of the whole model."""

    max_code: torch.Tensor  # int64: the largest |code| it may send in each block
    norm: torch.Tensor  # float64: the norm its codes in each block may reach, before rounding's share
    least: Optional[torch.Tensor] = None  # float64: the norm its codes in each block must reach (0: no floor)

    def norm_over(self, blocks: slice) -> float:
        return float(self.norm[blocks].square().sum().sqrt()) * (1 + NORM_SLACK)

    def why_not(self, codes: torch.Tensor, start: int) -> str:
        """Why `codes`, the sender's codes from element `start` (a block boundary) on, break its claims, or ""."""
        if codes.numel() == 0:
            return ""
        blocks = _blocks_of(codes, start)
        if blocks.stop > self.max_code.numel():
            return f"codes beyond the model's {self.max_code.numel()} blocks"
        over = _block_maxima(codes) > self.max_code[blocks]
        if bool(over.any()):
            beyond = blocked(codes.abs().to(torch.int64)) > self.max_code[blocks].unsqueeze(1)
            return (f"{int(beyond.sum())} codes beyond the block maxima it claimed (of {codes.numel()}; the first in "
                    f"block {blocks.start + int(over.nonzero()[0])})")
        bound = self.norm_over(blocks) + 0.5 * int(torch.count_nonzero(codes)) ** 0.5
        norm = _norm(codes)
        if norm > bound:
            return f"its codes' norm {norm:.4g} is beyond the {bound:.4g} its claimed norms allow"
        return self._short_of_floor(codes, blocks)

    def _short_of_floor(self, codes: torch.Tensor, blocks: slice) -> str:
        if self.least is None:
            return ""
        floored = self.least[blocks] > 0
        if not bool(floored.any()):
            return ""
        squares = _block_squares(codes)
        values = torch.full((floored.numel(),), BLOCK, dtype=torch.float64)
        values[-1] = codes.numel() - BLOCK * (floored.numel() - 1)  # a last short block
        least = float(self.least[blocks][floored].square().sum().sqrt()) * (1 - NORM_SLACK)
        floor = least - 0.5 * float(values[floored].sum()) ** 0.5
        norm = float(squares[floored].sum().sqrt())
        if norm < floor:
            return f"its codes' norm {norm:.4g} is short of the {floor:.4g} its claimed norms ask"
        return ""


def sum_why_not(total: torch.Tensor, start: int, claims: list[Claims]) -> str:
    """Why `total`, a reducer's sum of a part from element `start` on, cannot be a sum of codes that each met
    these senders' claims, or "". Every member holds every sender's claims, so each can check each part's sum
    alike: a reducer that serves a sum beyond them fails the round for everyone, and everyone names it."""
    if total.numel() == 0 or not claims:
        return ""
    blocks = _blocks_of(total, start)
    if bool((_block_maxima(total) > sum(c.max_code[blocks] for c in claims)).any()):
        return "a sum beyond what its senders' claimed block maxima allow"
    rounding = 0.5 * total.numel() ** 0.5  # each sender's share, at most (a sum does not say who sent zeros)
    bound = sum(c.norm_over(blocks) + rounding for c in claims)
    norm = _norm(total)
    if norm > bound:
        return f"a sum of norm {norm:.4g}, beyond the {bound:.4g} its senders' claimed norms allow"
    return ""


def _blocks_of(values: torch.Tensor, start: int) -> slice:
    if start % BLOCK:
        raise ValueError(f"a checked span starts at element {start}, inside a block")
    return slice(start // BLOCK, start // BLOCK + n_blocks(values.numel()))


def _block_maxima(values: torch.Tensor) -> torch.Tensor:
    """max |value| of each block, as int64 (to compare with claims), without a padded copy: whole blocks are a
    view, and only a last short block is reduced on its own."""
    whole = values.numel() // BLOCK * BLOCK
    lo, hi = values[:whole].view(-1, BLOCK).aminmax(dim=1)
    top = torch.maximum(hi.to(torch.int64), lo.to(torch.int64).neg())  # int64 first: −2^31 has no int32 abs
    if whole == values.numel():
        return top
    tail = values[whole:].to(torch.int64).abs().max().reshape(1)
    return torch.cat([top, tail])


def _block_squares(values: torch.Tensor) -> torch.Tensor:
    """The sum of squares of each block of integer values, in float64 (the last block may be short)."""
    x = values.double().square()
    whole = x.numel() // BLOCK * BLOCK
    out = x[:whole].view(-1, BLOCK).sum(dim=1)
    return out if whole == x.numel() else torch.cat([out, x[whole:].sum().reshape(1)])


def _norm(values: torch.Tensor) -> float:
    """The L2 norm of integer values, in float64 (their squares exceed what int32 and float32 hold exactly)."""
    x = values.double()
    return float(torch.dot(x, x).sqrt())


def claims_in_codes(maxabs: torch.Tensor, clipped: torch.Tensor, norms: torch.Tensor, weight: float,
                    scales: torch.Tensor, limit: int, maxima: bool = True,
                    backing: Optional[torch.Tensor] = None) -> Claims:
    """A sender's claims as code bounds, on the group's scales. `maxabs`: its block maxima as the island
    clipped them; `clipped`: which were; `norms`: its claimed block norms; `maxima`: whether the block statistic
    is the maximum (int2 agrees its scale from the mean |value|, which honest codes exceed). The arithmetic
    follows the quantizer's (p2pdiloco.core.exact.quantize: w·x first, then / scale, in float64), so an honest
    member's codes meet the bound exactly. `backing` (per block, the island's IslandPlan.backing): hold the codes
    to at least that share of the claimed norm too (dense formats whose statistic is the maximum only: top-k sends
    a fraction of each block, and int2's codes of values past its scale are clamped by no known share)."""
    scales = scales.double()
    top = torch.full_like(scales, limit, dtype=torch.int64)
    norm = (norms.double() * weight).div_(scales)
    if maxima:
        own = (maxabs.double() * weight).div_(scales).round_().clamp_(0, limit).to(torch.int64)
        top = torch.where(clipped, top, own)
    least = norm * backing.double() if backing is not None and maxima else None
    return Claims(top, norm, least)
