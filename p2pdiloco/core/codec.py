"""Compressed pseudo-gradients that still sum exactly: b-bit integer codes, packed to their width.

Each member sends round(w·Δ / scale) clamped to ±L (L = 2^(b−1) − 1: int8 ±127, int4 ±7, int2 ±1), on per-block
scales the whole group agrees on (the largest gathered block maximum maps to L), so codes from different members
add up as plain integers. Codes travel packed to b bits; a sum of N codes needs `sum_width(b, N)` bits and travels
packed to that width. Every member decodes the same integer sum, so members stay bitwise equal whatever the
codec; what quantization dropped is kept by the sender (`ErrorFeedback`) and added to its next contribution.
Packed parts of 16 bits or fewer then go through a lossless entropy stage (`compress`, Zstandard): codes crowd
around zero (int4 codes of real pseudo-gradients carry ~2.7 bits of information in 4), so it takes ~30 % off
without changing a bit; wider ones (the default's 20-bit codes) go as they are (`lossless`).

Pure tensor code: no network, no clock. The transport that moves packed parts is separate, and so is how much
of the model one round carries (fragments), so both can change without touching this module.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import zstandard

from p2pdiloco.core import exact
# dequantize and n_blocks are this module's API too: every wire format shares core.exact's arithmetic
from p2pdiloco.core.exact import BLOCK, block_maxabs, blocked, blockwise, dequantize, n_blocks, scales_for
from p2pdiloco.runtime.paging import LetGo, hold

# --compression none: 20-bit codes, finer than a fp32 all-reduce of exact integers could carry (its sums had to
# stay below 2^24, so codes of groups of 2 to 16 had 15 to 18 bits); what they drop is ~2^-20 of the block
# maximum, so no error feedback is needed
BITS = {"none": 20, "int8": 8, "int4": 4, "int2": 2}


def levels(bits: int) -> int:
    """Largest |code|: symmetric, so zero is exact and the sign costs nothing extra."""
    if not 2 <= bits <= 24:
        raise ValueError(f"codes of {bits} bits are not supported (2..24)")
    return (1 << (bits - 1)) - 1


def agreed_scales(maxabs: Sequence[torch.Tensor], bits: int) -> torch.Tensor:
    """Per-block step shared by the group: the largest gathered |value| maps to the largest code."""
    return scales_for(maxabs, levels(bits))


def quantize(x: torch.Tensor, scales: torch.Tensor, bits: int, weight: float = 1.0) -> torch.Tensor:
    """Codes of w·x as int32 in [−L, L]; |w·x − code·scale| ≤ scale/2 where |w·x| ≤ L·scale (clamped beyond).
    p2pdiloco.core.exact's arithmetic, into int32; `dequantize` is exact's too."""
    return exact.quantize(x, weight, scales, levels(bits), out=torch.empty(x.numel(), dtype=torch.int32))


def sum_width(bits: int, group_size: int) -> int:
    """Bits a sum of `group_size` codes travels at: what holds any such sum, rounded up to a width that divides a
    byte (1, 2, 4, 8), or above 8 to one `pack` handles. A value that straddles bytes hides its distribution from
    the lossless stage, a coder of byte values: int4 sums of 2-8 members kept 0.45-0.76 bytes a value at 5-7 bits
    and 0.28-0.40 as bytes, int2 sums of 2 or 3 0.31-0.34 at 3 bits and 0.23-0.27 at 4 (heavy-tailed tests), and
    such widths pack and unpack several times faster."""
    need = math.ceil(math.log2(2 * group_size * levels(bits) + 1))
    return next(w for w in (1, 2, 4, 8) if w >= need) if need <= 8 else packable_width(need)


def packable_width(width: int) -> int:
    """Widths pack into whole bytes per group of ≤ 64 bits: any of 1..8, even up to 16, multiples of 4 to 32."""
    for w in range(max(1, width), 33):
        if w <= 8 or (w <= 16 and w % 2 == 0) or w % 4 == 0:
            return w
    raise ValueError(f"cannot pack {width}-bit values")


def _group(width: int) -> tuple[int, int]:
    """(values per group, bytes per group) such that a group is whole bytes and fits in 64 bits."""
    values = 8 // math.gcd(width, 8)
    return values, values * width // 8


PACK_SLICE = 1 << 20  # values per slice of pack/unpack: their numpy temporaries take ~20 bytes per value


def pack(values: torch.Tensor, width: int) -> bytes:
    """Signed integers with |v| < 2^(width−1), `width` bits each, little-endian, padded to whole groups. A
    slice of whole groups at a time: the same bytes, with a slice's temporaries instead of a part's."""
    if width != packable_width(width):
        raise ValueError(f"width {width} is not packable; use packable_width()")
    per, nbytes = _group(width)
    step = PACK_SLICE - PACK_SLICE % per
    return b"".join(_pack_slice(values[i:i + step], width, per, nbytes)
                    for i in range(0, max(values.numel(), 1), step))


def _word(nbytes: int) -> np.dtype:
    """The narrowest little-endian unsigned integer that holds a group of `nbytes` bytes: int4 and int8 codes
    are packed and unpacked as bytes, not as 8-byte words (the work is memory traffic: 8× less of it)."""
    return np.dtype("<u1" if nbytes == 1 else "<u2" if nbytes == 2 else "<u4" if nbytes <= 4 else "<u8")


def _pack_slice(values: torch.Tensor, width: int, per: int, nbytes: int) -> bytes:
    """A group's values OR-ed into one word at their bit offsets (`_word`), then its low `nbytes` bytes written
    out: each step is one numpy pass, with no per-row copies."""
    v = (values if values.dtype in (torch.int32, torch.int64) else values.to(torch.int64)).numpy()
    offset = 1 << (width - 1)
    if v.size and (int(v.min()) < -offset or int(v.max()) >= offset):
        raise ValueError(f"a value does not fit in {width} bits")
    word = _word(nbytes)
    u = np.zeros(-(-v.size // per) * per, dtype=word)  # the padding stays 0, as it always has
    u[:v.size] = v  # a negative wraps, and adding the offset wraps it back
    u[:v.size] += word.type(offset)
    u = u.reshape(-1, per)
    words = u[:, 0].copy()
    for k in range(1, per):
        words |= np.left_shift(u[:, k], word.type(k * width))
    if nbytes == word.itemsize:
        return words.tobytes()
    out, shifted = np.empty((words.size, nbytes), dtype=np.uint8), np.empty_like(words)
    for j in range(nbytes):  # a byte plane at a time: one pass with a fixed stride (per-row copies were 5× slower)
        out[:, j] = np.right_shift(words, word.type(8 * j), out=shifted)  # its low byte: setitem truncates
    return out.tobytes()


def unpack(data: bytes, width: int, n: int) -> torch.Tensor:
    """The inverse of `pack`: n signed integers (int32: every packable width fits), a slice at a time. Raises
    ValueError if `data` has the wrong length, or padding bits that are not 0 (what `pack` writes): one part has
    one encoding, and a peer cannot carry anything in bits nobody reads."""
    per, nbytes = _group(width)
    groups = -(-n // per)
    if len(data) != groups * nbytes:
        raise ValueError(f"expected {groups * nbytes} bytes for {n} values of {width} bits, got {len(data)}")
    if nbytes == 1:  # a byte holds whole values: all of a byte's looked up at once (2-3× faster than shifting)
        out = torch.from_numpy(_byte_values(width)[np.frombuffer(data, dtype=np.uint8)].view(np.int32))
    else:
        out = torch.empty(groups * per, dtype=torch.int32)
        step = max(1, PACK_SLICE // per)  # groups per slice
        for g in range(0, groups, step):
            _unpack_slice(data[g * nbytes:(g + step) * nbytes], width, nbytes, out[g * per:(g + step) * per].numpy())
    if out.numel() > n and bool((out[n:] != -(1 << (width - 1))).any()):  # stored 0 reads as −offset
        raise ValueError(f"padding bits after the {n} values are not 0")
    return out[:n]


@functools.lru_cache(maxsize=None)
def _byte_values(width: int) -> np.ndarray:
    """Byte b's 8 // width values (int32) as element b, one element of their joint size: one byte's values are
    then read by plain indexing, numpy's fastest gather."""
    per, offset = 8 // width, 1 << (width - 1)
    b = np.arange(256, dtype=np.int32)[:, None]
    values = ((b >> (np.arange(per, dtype=np.int32) * width)) & ((1 << width) - 1)) - offset
    return np.ascontiguousarray(values).view(np.dtype(f"V{4 * per}")).ravel()


def _unpack_slice(chunk: bytes, width: int, nbytes: int, out: np.ndarray) -> None:
    """Each group read as one little-endian word (`_word`) at its byte offset (an unaligned view with a stride
    of `nbytes`; zero bytes after the data keep the last read inside the buffer), its values shifted and masked
    straight into `out`. Bits past a group's end belong to the next group and are never extracted: value k
    takes bits [k·width, (k+1)·width), below per·width. In int32, a 32-bit value wraps and taking the offset
    off wraps it back."""
    word = _word(nbytes)
    groups = len(chunk) // nbytes
    padded = np.zeros(len(chunk) + word.itemsize, dtype=np.uint8)
    padded[:len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
    words = np.ndarray((groups,), dtype=word, buffer=padded, strides=(nbytes,))
    values, shifted = out.reshape(groups, -1), np.empty(groups, dtype=word)
    mask = word.type((1 << width) - 1)
    for k in range(values.shape[1]):
        np.right_shift(words, word.type(k * width), out=shifted)
        values[:, k] = np.bitwise_and(shifted, mask, out=shifted)
    out -= np.int32(1 << (width - 1)) if width < 32 else np.int32(-(1 << 31))


def packed_bytes(n: int, width: int) -> int:
    per, nbytes = _group(width)
    return -(-n // per) * nbytes


@dataclass
class ErrorFeedback:
    """What quantization dropped from our contributions, in Δ units, added to the next one.

    With it, the applied updates track the uncompressed ones: after t rounds Σ sent = Σ Δ − residual, and the
    residual stays within one quantization step per element instead of growing with t.

    `decay` (β) scales the residual before it is carried: SparseLoCo's accumulator e ← β·e + Δ. With β < 1 and no
    outer momentum, the decayed residual stands in for the outer momentum (values top-k left unsent build up
    like a momentum buffer), and what top-k never selects fades instead of piling up."""

    residual: Optional[torch.Tensor] = None
    decay: float = 1.0
    # where the residual, a model-sized vector, is made: memory by default. A peer whose state waits on disk gives
    # a file-backed store (runtime.paging.PagedStore) whose chunks each pass lets go once done: the residual then
    # costs a pass a chunk of memory, not 4 bytes per parameter for the whole run
    store: "VectorStore" = field(default_factory=lambda: VectorStore())

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """Δ plus what earlier rounds' codes dropped (decayed), as a new tensor."""
        if self.residual is None:
            return delta
        out = delta.clone()
        self.compensate_(out)
        return out

    def compensate_(self, delta: torch.Tensor, part: slice = slice(0, None)) -> None:
        """`compensate` in place, a chunk at a time (elementwise: the bits of the whole-vector sum). `part`: which
        elements of the whole contribution `delta` holds (a pass over it a chunk at a time)."""
        if self.residual is not None:
            residual = self.residual[part]
            for chunk, _ in blockwise(delta.numel()):
                delta[chunk] += self._carried(residual[chunk])
                self.store.let_go(residual[chunk])

    def _carried(self, residual: torch.Tensor) -> torch.Tensor:
        return residual if self.decay == 1.0 else residual * self.decay  # elementwise: a chunk's bits are the whole's

    def record(self, intended: torch.Tensor, sent: torch.Tensor) -> None:
        residual = torch.empty(intended.numel(), dtype=torch.float32)
        for part, _ in blockwise(intended.numel()):  # elementwise, a chunk of float64 at a time
            residual[part] = (intended[part].double() - sent[part].double()).float()
        self.residual = residual

    def record_encoded(self, contribution: torch.Tensor, weight: float, scales: torch.Tensor, bits: int,
                       fmt: Optional[DenseFormat] = None) -> None:
        """`record` of what `encode` sent of `compensate(contribution)`, a chunk of blocks at a time (codes and
        selection are per block, compensating elementwise: the same bits as over the whole vector). So neither
        the compensated contribution is kept while the round runs, nor model-sized codes, selection or `sent`
        made afterwards (13 to 17 bytes per parameter in all); the residual is overwritten in place."""
        old, n = self.residual, contribution.numel()
        residual = old if old is not None else self.store.empty(n)
        for part, blocks in blockwise(n):
            intended = contribution[part] if old is None else contribution[part] + self._carried(old[part])
            sent = encode(intended, weight, scales[blocks], bits, fmt).sent
            residual[part] = (intended.double() - sent.double()).float()
            self.store.let_go(residual[part])
        self.residual = residual

    def alone(self, contribution: torch.Tensor, bits: int, fmt: "DenseFormat", out: Optional[torch.Tensor] = None,
              let_go: LetGo = hold) -> torch.Tensor:
        """The update a member alone in its round merges: what its codes would carry in an island (its compensated
        contribution, on scales from its own block statistics, the elements `fmt` selects), the rest carried as
        in an island. The outer step then gets the same kind of update whatever the island's size: a top-k
        member that merged its whole Δ alone would step at an outer lr tuned for 2 % of it (at lr 2, val went
        from 1.97 to 2.30 in that one round). A chunk of blocks at a time, like `record_encoded`, into `out` (a new
        tensor by default), `let_go` told each chunk of it once written."""
        old, n = self.residual, contribution.numel()
        merged = out if out is not None else torch.empty(n)
        residual = old if old is not None else self.store.empty(n)
        for part, _ in blockwise(n):
            intended = contribution[part] if old is None else contribution[part] + self._carried(old[part])
            scales = agreed_scales([fmt.block_statistic(intended).double()], bits)
            merged[part] = encode(intended, 1.0, scales, bits, fmt).sent
            residual[part] = (intended.double() - merged[part].double()).float()
            self.store.let_go(residual[part])
            let_go(part)
        self.residual = residual
        return merged


class VectorStore:
    """Where a model-sized fp32 vector is made, and what a pass does with a chunk of it once done: here, memory,
    and nothing. `runtime.paging.PagedStore` is the same two calls over a file."""

    def empty(self, n: int) -> torch.Tensor:
        return torch.empty(n)

    def let_go(self, view: torch.Tensor) -> None:
        pass


# ---- the lossless stage: every packed part goes on the wire through it ----------------------------------------
RAW, ZSTD = 0, 2  # the first byte of a wire payload (1 was DEFLATE, which peers sent until 2026-11-26: refused)

# Zstandard, tuned to be a fast coder of byte values: packed codes are skewed byte values with few repeats longer
# than a few bytes, so matches only cost bits; asking for matches of 7 bytes or more from a tiny table leaves
# nearly every byte to its Huffman literals. Against the DEFLATE of runs (zlib's Z_RLE) it replaced, on pieces of
# heavy-tailed test codes on one core here (scripts/bench/bench_codec.py): the same size (int4 35 % kept, int8 56 %,
# int2 67 %) at 3-9× the speed each way (int4 170-260 MB/s in against 62-77), where level 1 kept int4 at 39 %. On a
# 2-core testbed of 4 peers DEFLATE made an int4 round CPU-bound (docs/bandwidth.md). Wider values than 16 bits go
# as they are: Zstandard took 8 % off synthetic 20-bit codes (at ~440 MB/s), DEFLATE ~4 % off a real Δ's, a
# gain not yet measured against its CPU on the testbed.
COMPRESS_MAX_WIDTH = 16
ZSTD_PARAMS = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=6, search_log=1,
                                                            write_content_size=True)
ZSTD_MAX_WINDOW = 1 << 23  # a frame may not ask for more history than this (a part is at most a few MB)


def lossless(raw: bytes, width: int) -> bytes:
    """The wire form of values packed at `width` bits: compressed where that pays (above), else stored."""
    return compress(raw) if width <= COMPRESS_MAX_WIDTH else bytes([RAW]) + raw


def compress(raw: bytes) -> bytes:
    """Zstandard (above), or the bytes as they are when that is not smaller (random-looking data)."""
    packed = zstandard.ZstdCompressor(compression_params=ZSTD_PARAMS).compress(raw)
    return bytes([ZSTD]) + packed if len(packed) < len(raw) else bytes([RAW]) + raw


def expand(data: bytes, max_raw: int) -> bytes:
    """The inverse of `compress`, never producing more than `max_raw` bytes: a frame must state its size, and one
    that states more (a compression bomb, an overlong part) is refused before anything is expanded; anything else
    raises ValueError."""
    if not data or data[0] not in (RAW, ZSTD):
        raise ValueError("a part without a known encoding tag")
    if data[0] == RAW:
        if len(data) - 1 > max_raw:
            raise ValueError(f"a part longer than the {max_raw} bytes it may take")
        return data[1:]
    try:
        size = zstandard.frame_content_size(data[1:])
        if size < 0 or size > max_raw:
            raise ValueError(f"a compressed part that does not state a size within the {max_raw} bytes it may "
                             f"take ({size})")
        raw = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).decompress(
            data[1:], max_output_size=max_raw, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ValueError(f"a part that does not expand: {e}") from None
    if len(raw) != size:
        raise ValueError(f"a part that expands to {len(raw)} bytes where its frame states {size}")
    return raw


# ---- wire formats of one part: dense codes, or the top-k of each block --------------------------------------
INDEX_WIDTH = packable_width(math.ceil(math.log2(BLOCK)))  # an index inside a block
COUNT_WIDTH = packable_width(math.ceil(math.log2(BLOCK + 1)))  # entries of one block in a sparse sum


def block_spans(start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) cut at block boundaries (parts are block-aligned, so blocks lie within one part)."""
    return [(a, min(a + BLOCK, end)) for a in range(start, end, BLOCK)]


@dataclass(frozen=True)
class DenseFormat:
    """Every code of the part, packed to `bits`; the sum packed to its width."""

    bits: int
    group_size: int

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """Which elements a member sends: all of them."""
        return torch.ones(x.numel(), dtype=torch.bool)

    def block_statistic(self, x: torch.Tensor) -> torch.Tensor:
        """What a member gathers per block so the group can agree on its scale (times its merge weight, the
        largest member's value becomes the step of code 1·L). With several levels: the block maximum, so nothing
        clamps. With one level (int2: −1, 0, +1) the maximum would round nearly every value to 0 (96 % of a real
        Δ's); the mean |value| of what the format sends is the step that loses least (EF-signSGD's scale), and
        error feedback carries what clamping cut off."""
        if levels(self.bits) > 1:
            return block_maxabs(x)
        selected = self.select(x)
        magnitude = blocked((x.abs() * selected).double()).sum(dim=1)
        return (magnitude / blocked(selected.double()).sum(dim=1).clamp(min=1)).float()

    def encode(self, codes: torch.Tensor, selected: torch.Tensor) -> bytes:
        return lossless(pack(codes, self.bits), self.bits)

    def decode(self, data: bytes, length: int) -> torch.Tensor:
        codes = unpack(expand(data, packed_bytes(length, self.bits)), self.bits, length)
        self._check_range(codes)
        return codes

    def encode_sum(self, total: torch.Tensor) -> bytes:
        width = sum_width(self.bits, self.group_size)
        return lossless(pack(total, width), width)

    def decode_sum(self, data: bytes, length: int) -> torch.Tensor:
        width = sum_width(self.bits, self.group_size)
        data = expand(data, packed_bytes(length, width))
        if len(data) != packed_bytes(length, width):
            raise ValueError(f"a sum of {length} values takes {packed_bytes(length, width)} bytes, got {len(data)}")
        return unpack(data, width, length)

    def _check_range(self, codes: torch.Tensor) -> None:
        if codes.numel() and max(-int(codes.min()), int(codes.max())) > levels(self.bits):
            raise ValueError(f"codes beyond ±{levels(self.bits)}")


@dataclass(frozen=True)
class TopKFormat(DenseFormat):
    """SparseLoCo-style: per block, the k largest |values| (k = ⌈fraction·block⌉) as (index, code) pairs; every
    block carries exactly k, so a sender cannot smuggle in a dense update. The sum goes back as the union of the
    members' indices, with a count per block and the exact sums at their width."""

    fraction: float = 0.0156

    def k(self, block_len: int) -> int:
        return max(1, min(block_len, math.ceil(self.fraction * block_len)))

    def select(self, x: torch.Tensor) -> torch.Tensor:
        selected = torch.zeros(x.numel(), dtype=torch.bool)
        for a, b in block_spans(0, x.numel()):
            top = torch.topk(x[a:b].abs(), self.k(b - a), sorted=False).indices
            selected[a + top] = True
        return selected

    def encode(self, codes: torch.Tensor, selected: torch.Tensor) -> bytes:
        indices, values = [], []
        for a, b in block_spans(0, codes.numel()):
            local = torch.nonzero(selected[a:b]).flatten()
            indices.append(local)
            values.append(codes[a:b][local])
        flat_idx, flat_val = torch.cat(indices or [torch.zeros(0, dtype=torch.int64)]), \
            torch.cat(values or [torch.zeros(0, dtype=torch.int64)])
        return compress(pack(flat_idx - (1 << (INDEX_WIDTH - 1)), INDEX_WIDTH) + pack(flat_val, self.bits))

    def decode(self, data: bytes, length: int) -> torch.Tensor:
        spans = block_spans(0, length)
        total_k = sum(self.k(b - a) for a, b in spans)
        index_bytes = packed_bytes(total_k, INDEX_WIDTH)
        data = expand(data, index_bytes + packed_bytes(total_k, self.bits))
        if len(data) != index_bytes + packed_bytes(total_k, self.bits):
            raise ValueError(f"a top-k part of {length} values takes {index_bytes + packed_bytes(total_k, self.bits)}"
                             f" bytes, got {len(data)}")
        indices = unpack(data[:index_bytes], INDEX_WIDTH, total_k) + (1 << (INDEX_WIDTH - 1))
        values = unpack(data[index_bytes:], self.bits, total_k)
        self._check_range(values)
        dense, at = torch.zeros(length, dtype=torch.int32), 0
        for a, b in spans:
            k = self.k(b - a)
            local = indices[at:at + k]
            if k and (int(local.max()) >= b - a or (k > 1 and not bool((local[1:] > local[:-1]).all()))):
                raise ValueError("top-k indices out of their block or not strictly increasing")
            dense[a + local] = values[at:at + k]
            at += k
        return dense

    def encode_sum(self, total: torch.Tensor) -> bytes:
        counts, indices, values = [], [], []
        for a, b in block_spans(0, total.numel()):
            local = torch.nonzero(total[a:b]).flatten()
            counts.append(local.numel())
            indices.append(local)
            values.append(total[a:b][local])
        n = sum(counts)
        return compress(pack(torch.tensor(counts, dtype=torch.int64) - (1 << (COUNT_WIDTH - 1)), COUNT_WIDTH)
                       + pack(torch.cat(indices) - (1 << (INDEX_WIDTH - 1)) if n else torch.zeros(0), INDEX_WIDTH)
                       + pack(torch.cat(values) if n else torch.zeros(0), sum_width(self.bits, self.group_size)))

    def decode_sum(self, data: bytes, length: int) -> torch.Tensor:
        spans = block_spans(0, length)
        count_bytes = packed_bytes(len(spans), COUNT_WIDTH)
        width = sum_width(self.bits, self.group_size)  # at most every element, each with an index and a sum
        data = expand(data, count_bytes + packed_bytes(length, INDEX_WIDTH) + packed_bytes(length, width))
        if len(data) < count_bytes:
            raise ValueError("sparse sum too short for its counts")
        counts = (unpack(data[:count_bytes], COUNT_WIDTH, len(spans)) + (1 << (COUNT_WIDTH - 1))).tolist()
        n = sum(counts)
        index_bytes = packed_bytes(n, INDEX_WIDTH)
        if len(data) != count_bytes + index_bytes + packed_bytes(n, width):
            raise ValueError("sparse sum of the wrong length")
        indices = unpack(data[count_bytes:count_bytes + index_bytes], INDEX_WIDTH, n) + (1 << (INDEX_WIDTH - 1))
        values = unpack(data[count_bytes + index_bytes:], width, n)
        dense, at = torch.zeros(length, dtype=torch.int32), 0
        for (a, b), c in zip(spans, counts):
            local = indices[at:at + c]
            if c > b - a or (c and int(local.max()) >= b - a):
                raise ValueError("sparse sum indices out of their block")
            dense[a + local] = values[at:at + c]
            at += c
        return dense


@dataclass
class Encoded:
    """One member's contribution as sent: the codes it sends (0 where the format selects nothing), which elements
    the format selected, and what of its Δ reaches the group's sum (for error feedback)."""

    codes: torch.Tensor  # int32 in [−L, L]
    selected: torch.Tensor  # bool
    sent: Optional[torch.Tensor]  # dequantized codes / weight, in Δ units (None where not asked for)


def encode(delta: torch.Tensor, weight: float, scales: torch.Tensor, bits: int,
           fmt: Optional[DenseFormat] = None, with_sent: bool = True) -> Encoded:
    """w·Δ as codes on the group's scales, the elements `fmt` selects (all, by default). The averager sends these
    codes and the host's error feedback records their `sent`: one computation, so the two always agree. (The
    averager itself needs no `sent`: a model-sized vector it need not hold.)"""
    fmt = fmt or DenseFormat(bits, 1)
    selected = fmt.select(delta)  # w > 0 ranks |w·Δ| as |Δ|: the same selection
    codes = quantize(delta, scales, bits, weight)
    if isinstance(fmt, TopKFormat):  # a dense format selects everything
        codes.mul_(selected)
    return Encoded(codes, selected, sent_of(codes, scales, weight) if with_sent else None)


def sent_of(codes: torch.Tensor, scales: torch.Tensor, weight: float) -> torch.Tensor:
    """What of a member's Δ its codes carry: code·scale / w, a chunk at a time (elementwise: the same bits as
    over the whole vector, without its float64 copies)."""
    sent = torch.zeros(codes.numel(), dtype=torch.float32)
    if weight > 0:
        for part, blocks in blockwise(codes.numel()):
            sent[part] = dequantize(codes[part], scales[blocks]).double().div_(weight).float()
    return sent
