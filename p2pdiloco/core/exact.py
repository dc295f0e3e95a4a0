"""Exact weighted sums of pseudo-gradients: block-scaled integer codes, the arithmetic every wire format shares.

Why: averaging floats leaves members ulps apart (hivemind returns each member `local + fl(mean − local)`, which
differs from the mean, and between members, in ~35% of elements), so peers that "averaged" drift apart round
after round. Integers add exactly in any order, so each member sends its token-weighted pseudo-gradient as
integer codes on per-block scales the whole group agrees on (from gathered block statistics); every member
decodes the same integer sum to the same fp32 bits, on any IEEE hardware. Chunked float64 arithmetic keeps
temporaries to a few MB, whatever the model's size. The codes' width and how they travel are
p2pdiloco.core.codec's and p2pdiloco.swarm.codes's.
"""

from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import torch

from p2pdiloco.runtime.paging import LetGo, hold

BLOCK = 1 << 14  # elements per quantization block (one scale each)
# elements per chunk of a pass's arithmetic: its temporaries (float64, int64, int32) are 4-8 MB, a pass over a 100M
# vector needs ~40 MB beside it, and runs faster than with 4M-element chunks (cache); those chunks' 16-32 MB
# temporaries made a pass's working set 96-181 MB, and the holes they left in glibc's heaps stayed resident
# (docs/hardware.md)
_CHUNK = 1 << 20


def n_blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def block_maxabs(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each block, a chunk at a time (no model-sized |x| and padded copies)."""
    out = torch.empty(n_blocks(x.numel()), dtype=torch.float32)
    for part, blocks in blockwise(x.numel()):
        out[blocks] = blocked(x[part].abs().float()).amax(dim=1)
    return out


def scales_for(maxabs: Sequence[torch.Tensor], top_code: int) -> torch.Tensor:
    """Per-block step size shared by a group: the largest |value| any member sends maps to `top_code`
    (an all-zero block gets step 1, so it stays zero)."""
    top = torch.stack([m.double() for m in maxabs]).amax(dim=0)
    scales = top / top_code
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def blocked(x: torch.Tensor) -> torch.Tensor:
    """A zero-padded copy of x as (blocks, BLOCK): per-block scales broadcast instead of being repeated for
    every element, and the arithmetic runs in place (1.6× faster on 10 M elements, the same bits)."""
    return torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)


def chunks(n: int, size: int = _CHUNK) -> Iterator[slice]:
    """Slices covering n elements `size` at a time: a pass over a model-sized vector with a chunk's
    temporaries, which can let each chunk go (page it out) as soon as it is done."""
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def all_finite(*tensors: torch.Tensor, let_go: LetGo = hold) -> bool:
    """No NaN or infinity in any of them, a chunk at a time: `torch.isfinite` of a whole model-sized vector makes
    model-sized temporaries (|x| as floats and bool masks, ~5 B/param) at a round's end, when a peer's memory
    peaks. `let_go` is told each chunk's elements once checked (a file-backed vector lets their pages go)."""
    for t in tensors:
        flat = t.reshape(-1)
        for part in chunks(flat.numel()):
            finite = bool(torch.isfinite(flat[part]).all())
            let_go(part)
            if not finite:
                return False
    return True


def blockwise(n: int, blocks_per_chunk: int = _CHUNK // BLOCK):
    """(element slice, block slice) pairs covering n elements a few MB at a time: the float64 arithmetic below
    then needs a chunk's worth of temporaries, not several model-sized ones (a peer's peak memory)."""
    step = blocks_per_chunk * BLOCK
    for start in range(0, n, step):
        yield slice(start, min(n, start + step)), slice(start // BLOCK, (start + step) // BLOCK)


def quantize(delta: torch.Tensor, weight: float, scales: torch.Tensor, limit: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """round(w·Δ / scale), clamped to ±limit, into `out` (fp32 by default; the compressed codes use int32): the
    group may have clipped our block maxima (p2pdiloco.protocol.island), and a sum of values beyond it would not
    stay exact. `out` may be Δ itself."""
    q = torch.empty(delta.numel(), dtype=torch.float32) if out is None else out
    for part, blocks in blockwise(delta.numel()):
        x = blocked(delta[part].double()).mul_(weight).div_(scales[blocks].double().unsqueeze(1))
        q[part] = x.round_().clamp_(-limit, limit).view(-1)[: part.stop - part.start]
    return q


def dequantize(total: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """code·scale, rounded once to fp32: every member computes these bits from the same sum. `scales` starts at
    the block where `total` starts; `out` may be `total` itself, or a slice of a bigger buffer."""
    out = torch.empty(total.numel(), dtype=torch.float32) if out is None else out
    for part, blocks in blockwise(total.numel()):
        chunk = blocked(total[part].double()).mul_(scales[blocks].double().unsqueeze(1))
        out[part] = chunk.view(-1)[: part.stop - part.start]
    return out


def digest(*tensors: torch.Tensor, let_go: LetGo = hold) -> str:
    """Short content hash of tensors, one after the other (as if concatenated), for comparing peers' states bit
    for bit. Hashed in place, a chunk at a time: no concatenated or bytes copy of a model-sized state, and
    `let_go` is told each chunk's elements once hashed (a parked global state lets their pages go)."""
    h = hashlib.sha256()
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1)
        for part in chunks(flat.numel()):
            h.update(memoryview(flat[part].numpy()).cast("B"))
            let_go(part)
    return h.hexdigest()[:16]
