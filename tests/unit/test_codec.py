"""Compressed codes: round trips within their bound, lossless packing, exact integer sums, error feedback."""

import math

import pytest
import torch
import zstandard

from p2pdiloco.core import codec
from p2pdiloco.core.exact import _CHUNK, BLOCK

WIDTHS = [w for w in range(1, 33) if codec.packable_width(w) == w]


@pytest.mark.parametrize("width", WIDTHS)
def test_packing_is_lossless_at_every_width(width):
    g = torch.Generator().manual_seed(width)
    n = 1001  # not a multiple of any group
    lo, hi = -(1 << (width - 1)), (1 << (width - 1)) - 1
    values = torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64)
    values[:2] = torch.tensor([lo, hi])
    data = codec.pack(values, width)
    assert len(data) == codec.packed_bytes(n, width) <= (n * width + 63) // 8 + 8
    assert torch.equal(codec.unpack(data, width, n), values)


@pytest.mark.parametrize("width", WIDTHS)
def test_packed_bytes_are_one_little_endian_bitstream_whatever_the_packer(width):
    """The wire format, pinned: value i (offset by 2^(width−1)) takes bits [i·width, (i+1)·width) of one
    little-endian bitstream, zero-padded to a whole group. Peers of any version read each other's parts, and a
    faster packer (or unpacker, which reads each group as an unaligned 8-byte word) cannot change a bit."""
    g = torch.Generator().manual_seed(100 + width)
    n = 1001
    lo, hi = -(1 << (width - 1)), (1 << (width - 1)) - 1
    values = torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int32)
    values[:4] = torch.tensor([lo, hi, 0, -1])
    stream = sum((v - lo) << (i * width) for i, v in enumerate(values.tolist()))
    expected = stream.to_bytes(codec.packed_bytes(n, width), "little")
    assert codec.pack(values, width) == expected
    assert torch.equal(codec.unpack(expected, width, n), values)


def test_packing_refuses_what_does_not_fit_and_unpacking_checks_the_length():
    with pytest.raises(ValueError):
        codec.pack(torch.tensor([8]), 4)
    with pytest.raises(ValueError):
        codec.unpack(b"\x00" * 3, 4, 10)
    with pytest.raises(ValueError):
        codec.pack(torch.tensor([1]), 9)  # not a packable width


@pytest.mark.parametrize("name", ["none", "int4"])
def test_a_nan_in_a_contribution_cannot_even_be_packed(name):
    """NaN quantizes to a code out of ±L, which packing refuses: a peer that sends NaN sends nothing (its round
    fails, and its island blames it) rather than codes that would poison a sum. (±inf is clamped to ±L like any
    value beyond the agreed scale, and reducers hold such codes to the maxima their sender claimed.)"""
    bits = codec.BITS[name]
    fmt = codec.DenseFormat(bits, 3)
    honest = torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(0))
    scales = codec.agreed_scales([codec.block_maxabs(honest)], bits)
    for where in (0, BLOCK + 7, 2 * BLOCK - 1):
        sent = honest.clone()
        sent[where] = float("nan")
        enc = codec.encode(sent, 1.0, scales, bits, fmt, with_sent=False)
        with pytest.raises(ValueError):
            fmt.encode(enc.codes, enc.selected)


def test_the_lossless_stage_shrinks_codes_that_crowd_around_zero_and_never_grows_random_bytes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BLOCK, generator=g) * torch.rand(4 * BLOCK, generator=g) ** 4  # heavy tails, like Δ
    scales = codec.agreed_scales([codec.block_maxabs(x)], 4)
    raw = codec.pack(codec.quantize(x, scales, 4), 4)
    wire = codec.compress(raw)
    assert len(wire) < 0.8 * len(raw) and codec.expand(wire, len(raw)) == raw
    assert codec.DenseFormat(4, 1).encode(codec.quantize(x, scales, 4), None) == wire  # the formats use it
    noise = torch.randint(0, 256, (4096,), generator=g, dtype=torch.uint8).numpy().tobytes()
    assert codec.compress(noise) == bytes([codec.RAW]) + noise  # one tag byte is all it costs


def test_wide_codes_and_sums_go_as_they_are_narrow_ones_are_compressed():
    """A byte coder takes little off 20-bit codes and their 24-bit sums (codec.COMPRESS_MAX_WIDTH): the default's
    parts are stored, int8/int4/int2's compressed. Either decodes to the same values."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * BLOCK, generator=g) * torch.rand(2 * BLOCK, generator=g) ** 4
    for bits, tag in ((codec.BITS["none"], codec.RAW), (8, codec.ZSTD), (4, codec.ZSTD), (2, codec.ZSTD)):
        fmt = codec.DenseFormat(bits, 4)
        codes = codec.quantize(x, codec.agreed_scales([codec.block_maxabs(x)], bits), bits)
        wire, total = fmt.encode(codes, None), codes.to(torch.int64) * 4
        wire_sum = fmt.encode_sum(total)
        assert (wire[0], wire_sum[0]) == (tag, tag), bits
        assert torch.equal(fmt.decode(wire, x.numel()), codes.to(torch.int64))
        assert torch.equal(fmt.decode_sum(wire_sum, x.numel()), total)
        assert torch.equal(fmt.decode(codec.compress(codec.pack(codes, bits)), x.numel()), codes.to(torch.int64))


@pytest.mark.parametrize("bits, members", [(4, 2), (4, 3), (4, 4), (4, 8), (2, 2), (2, 3), (2, 8), (8, 4)])
def test_sums_travel_at_a_width_that_divides_a_byte_and_compress_smaller_than_packed_tight(bits, members):
    """A sum of 5 to 7 bits travels as a byte, one of 3 bits as 4: the lossless stage codes byte values, so a
    value that straddles bytes compresses worse than one padded to a byte's divisor. Wider sums are packed tight."""
    g = torch.Generator().manual_seed(members)
    x = [torch.randn(4 * BLOCK, generator=g) * torch.rand(4 * BLOCK, generator=g) ** 4 for _ in range(members)]
    scales = codec.agreed_scales([codec.block_maxabs(d) for d in x], bits)
    total = sum(codec.quantize(d, scales, bits).to(torch.int64) for d in x)
    need = math.ceil(math.log2(2 * members * codec.levels(bits) + 1))
    width = codec.sum_width(bits, members)
    assert width >= need and (8 % width == 0 if need <= 8 else width == codec.packable_width(need))
    fmt = codec.DenseFormat(bits, members)
    wire = fmt.encode_sum(total)
    assert torch.equal(fmt.decode_sum(wire, total.numel()), total)
    if width != need:
        assert len(wire) < len(codec.compress(codec.pack(total, codec.packable_width(need))))


def test_expanding_is_bounded_by_what_the_part_may_take():
    bomb = codec.compress(b"\x00" * (64 << 20))  # 64 MB of zeros in a few KB
    assert len(bomb) < (64 << 20) // 100
    with pytest.raises(ValueError, match="state a size within"):  # refused on what it states, unexpanded
        codec.expand(bomb, 1 << 20)
    unsized = bytes([codec.ZSTD]) + zstandard.ZstdCompressor(write_content_size=False).compress(b"\x00" * 1000)
    for bad, limit in ((bomb, 1 << 20), (bomb[:-10], 64 << 20), (b"", 10), (b"\x05abc", 10), (unsized, 1 << 20),
                       (bytes([codec.RAW]) + b"x" * 11, 10), (codec.compress(b"\x00" * 100), 0),
                       (codec.compress(b"\x00" * 100) + b"trailing", 100),
                       (bytes([codec.ZSTD]) + b"not zstd at all", 100), (bytes([1]) + b"retired DEFLATE tag", 100)):
        with pytest.raises(ValueError):
            codec.expand(bad, limit)


def test_a_frame_that_understates_its_size_is_refused_not_expanded_beyond_it():
    """The size a frame states is what the limit is checked against; a frame that then holds more is an error,
    never more than `max_raw` bytes of output."""
    frame = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(bytes(range(256)) * 400))
    descriptor = frame[4]
    assert descriptor >> 6 == 2  # a 4-byte content size, after the window byte (if any) and the dictionary id
    at = 5 + (0 if descriptor & 0x20 else 1) + (0, 1, 2, 4)[descriptor & 3]
    frame[at:at + 4] = (1000).to_bytes(4, "little")  # it holds 102 400 bytes and says 1000
    lying = bytes([codec.ZSTD]) + bytes(frame)
    assert zstandard.frame_content_size(lying[1:]) == 1000
    with pytest.raises(ValueError):
        codec.expand(lying, 5000)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_each_codec_round_trips_within_half_a_step(name):
    bits = codec.BITS[name]
    x = torch.randn(3 * BLOCK + 7, generator=torch.Generator().manual_seed(0))
    scales = codec.agreed_scales([codec.block_maxabs(x)], bits)
    codes = codec.quantize(x, scales, bits)
    assert int(codes.abs().max()) == codec.levels(bits)  # the block maximum maps to the largest code
    err = (codec.dequantize(codes, scales) - x).abs()
    step = scales.repeat_interleave(BLOCK)[: x.numel()]
    assert bool((err <= step / 2 * (1 + 1e-6)).all())
    assert len(codec.pack(codes, bits)) == codec.packed_bytes(x.numel(), bits) == -(-x.numel() * bits // 8)


def test_one_level_codes_agree_on_the_mean_magnitude_and_keep_far_more_of_the_signal():
    """int2 has one level: on the block maximum, nearly every value rounds to 0; on the mean |value| of what the
    format sends (EF-signSGD's scale), most values survive and the error drops (on a real Δ of the tiny model:
    0.82 → 0.42 dense, 0.56 → 0.16 for the top 2 %)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * BLOCK, generator=g) * torch.rand(2 * BLOCK, generator=g) ** 2  # heavier tails than normal

    def error_and_kept(fmt, statistic):
        scales = codec.agreed_scales([statistic], 2)
        enc = codec.encode(x, 1.0, scales, 2, fmt)
        sent_part = x * enc.selected
        kept = float((enc.codes[enc.selected] != 0).double().mean())
        return float((enc.sent - sent_part).norm() / sent_part.norm()), kept

    for fmt in (codec.DenseFormat(2, 1), codec.TopKFormat(2, 1, 0.02)):
        on_max = error_and_kept(fmt, codec.block_maxabs(x))
        on_mean = error_and_kept(fmt, fmt.block_statistic(x))
        assert on_mean[0] < 0.8 * on_max[0] and on_mean[1] > min(0.95, 10 * on_max[1]), (fmt, on_max, on_mean)
    assert error_and_kept(codec.TopKFormat(2, 1, 0.02), codec.TopKFormat(2, 1, 0.02).block_statistic(x))[1] > 0.95
    for fmt in (codec.DenseFormat(4, 1), codec.TopKFormat(4, 1, 0.02), codec.DenseFormat(8, 1)):
        assert torch.equal(fmt.block_statistic(x), codec.block_maxabs(x))  # several levels: nothing clamps


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_a_groups_codes_sum_exactly_and_every_member_decodes_the_same_bits(name):
    bits, n, members = codec.BITS[name], 2 * BLOCK + 3, 5
    g = torch.Generator().manual_seed(1)
    deltas = [torch.randn(n, generator=g) * (i + 1) for i in range(members)]
    weights = [0.1, 0.15, 0.2, 0.25, 0.3]
    maxabs = [codec.block_maxabs(d).double() * w for d, w in zip(deltas, weights)]  # gathered, times w
    scales = codec.agreed_scales(maxabs, bits)
    encoded = [codec.encode(d, w, scales, bits) for d, w in zip(deltas, weights)]
    total = sum(e.codes.to(torch.int64) for e in encoded)
    width = codec.sum_width(bits, members)
    assert codec.levels(bits) * members < 1 << (width - 1)  # the widest possible sum fits
    wire = codec.pack(total, width)  # what every member receives
    decoded = [codec.dequantize(codec.unpack(wire, width, n), scales) for _ in range(members)]
    assert all(torch.equal(decoded[0], d) for d in decoded)
    exact = sum(codec.dequantize(e.codes, scales).double() for e in encoded)
    assert torch.allclose(decoded[0].double(), exact, rtol=0, atol=1e-6 * float(exact.abs().max()))
    truth = sum(d.double() * w for d, w in zip(deltas, weights))
    step = scales.repeat_interleave(BLOCK)[:n]
    assert bool(((decoded[0].double() - truth).abs() <= members * step / 2 + 1e-6).all())


def test_error_feedback_makes_applied_updates_track_the_uncompressed_sum():
    """int2 of a signal far below one step: without feedback nothing is ever sent; with it, the running sum of
    what was sent stays within one step of the running sum of Δ."""
    bits, rounds = 2, 400
    g = torch.Generator().manual_seed(2)
    big = torch.zeros(BLOCK)
    big[0] = 10.0  # sets a coarse step for the block
    feedback = codec.ErrorFeedback()
    sent_with, sent_without, truth = torch.zeros(BLOCK), torch.zeros(BLOCK), torch.zeros(BLOCK)
    for _ in range(rounds):
        delta = big.clone()
        delta[1:] = 0.1 + 0.05 * torch.rand(BLOCK - 1, generator=g)
        truth += delta
        for fb, acc in ((feedback, sent_with), (None, sent_without)):
            intended = fb.compensate(delta) if fb else delta
            scales = codec.agreed_scales([codec.block_maxabs(intended)], bits)
            enc = codec.encode(intended, 1.0, scales, bits)
            if fb:
                fb.record(intended, enc.sent)
            acc += enc.sent
    step = 10.0 / codec.levels(bits)
    assert float((sent_without[1:] - truth[1:]).abs().max()) > rounds * 0.1 - 1e-3  # the signal was lost
    assert float((sent_with - truth).abs().max()) <= step / 2 + 1e-3  # Σ sent = Σ Δ − residual, |residual| ≤ step/2


# in a fresh process: in this one, what earlier tests freed and glibc kept resident would serve the pass's
# temporaries without a page of growth and hide them
FEEDBACK_PASS = """
import torch
from p2pdiloco.core import codec
from tests.harness.memory import PeakGrowth
n = 16 << 20
g = torch.Generator().manual_seed(0)
delta, feedback = torch.randn(n, generator=g), codec.ErrorFeedback(residual=torch.randn(n, generator=g) * 1e-3)
fmt = codec.DenseFormat(4, 2)
scales = codec.agreed_scales([codec.block_maxabs(delta) * 0.5], fmt.bits)
with PeakGrowth() as grew:
    feedback.record_encoded(delta, 0.5, scales, fmt.bits, fmt)
print(grew.bytes)
"""


def test_a_pass_of_error_feedback_holds_a_few_megabytes_beside_the_vectors():
    """A round's passes (error feedback's, the load of the averaging buffer, the statistics) run in the training
    process while it trains: what they hold beside the vectors adds to its peak. Over 16 M elements (64 MB),
    recording feedback holds 34 MB at once, its chunks' float64 and int32 temporaries; with the 4 M-element chunks
    of before, 133 MB. The pass runs with glibc's mmap threshold fixed at 1 MB, so that every temporary is mapped
    and unmapped: with the threshold glibc moves by itself, how much of a chunk's freed heap the next one reuses
    varies from run to run (40-83 MB measured for the same pass; 65 in one CI run), and what a heap keeps is
    given back by trims (test_heap.py), not by this pass."""
    from tests.harness.memory import PeakGrowth, fresh_python

    PeakGrowth()  # skips here where the kernel cannot reset the peak
    out = fresh_python(FEEDBACK_PASS, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})  # mallopt(3): a fixed threshold
    grew, vectors = int(out.split()[-1]), 4 * (16 << 20)
    assert grew < vectors, f"peak grew by {grew / 2**20:.0f} MB over {vectors / 2**20:.0f} MB vectors"


@pytest.mark.parametrize("decay", [1.0, 0.95], ids=["plain", "decayed"])
@pytest.mark.parametrize("fmt", [codec.DenseFormat(4, 3), codec.TopKFormat(2, 3, 0.02)], ids=["int4", "topk"])
def test_error_feedback_recorded_a_chunk_at_a_time_keeps_the_bits_of_the_whole_vector(fmt, decay):
    """The merger records feedback from the uncompensated contribution, a chunk of blocks at a time, after its
    round (holding neither the compensated vector nor model-sized codes): the residuals are those of
    compensating, encoding and recording the whole vector, round after round."""
    n = 2 * _CHUNK + 3 * BLOCK + 5  # several chunks, and a last block that is not full
    g = torch.Generator().manual_seed(4)
    whole, chunked = codec.ErrorFeedback(decay=decay), codec.ErrorFeedback(decay=decay)
    for _ in range(3):
        delta = torch.randn(n, generator=g)
        intended = whole.compensate(delta)
        scales = codec.agreed_scales([codec.block_maxabs(intended) * 0.6], fmt.bits)
        whole.record(intended, codec.encode(intended, 0.6, scales, fmt.bits, fmt).sent)
        chunked.record_encoded(delta, 0.6, scales, fmt.bits, fmt)
        assert torch.equal(chunked.residual, whole.residual)


@pytest.mark.parametrize("fmt", [codec.DenseFormat(4, 1), codec.TopKFormat(2, 1, 0.02), codec.DenseFormat(2, 1)],
                         ids=["int4", "topk", "int2"])
def test_a_member_alone_merges_what_its_codes_would_carry_and_carries_the_rest(fmt):
    """A round with nobody else merges, like an island's, the member's compensated contribution as its codes
    carry it (on scales from its own block statistics; top-k: 2 % of each block), never its whole Δ; what was
    left out rides along to the next round, as in an island, so the two rounds' sum tracks the two Δs."""
    from p2pdiloco.core.exact import _CHUNK

    n = _CHUNK + 3 * BLOCK + 5  # two chunks, and a last block that is not full
    g = torch.Generator().manual_seed(5)
    alone, island = codec.ErrorFeedback(decay=0.95), codec.ErrorFeedback(decay=0.95)
    deltas = [torch.randn(n, generator=g) for _ in range(2)]
    for delta in deltas:
        merged = alone.alone(delta, fmt.bits, fmt)
        intended = island.compensate(delta)  # what the same member sends in an island of its own weight 1
        scales = codec.agreed_scales([fmt.block_statistic(intended).double()], fmt.bits)
        sent = codec.encode(intended, 1.0, scales, fmt.bits, fmt).sent
        island.record(intended, sent)
        assert torch.equal(merged, sent) and torch.equal(alone.residual, island.residual)
        if isinstance(fmt, codec.TopKFormat):
            assert int(torch.count_nonzero(merged)) <= fmt.k(BLOCK) * codec.n_blocks(n)


def test_decayed_error_feedback_is_sparselocos_accumulator():
    """e ← β·e + Δ, sent = Q(top-k(e)), e ← e − sent: a value top-k never selects converges to Δ/(1 − β) instead
    of growing without bound, and a selected one leaves only its rounding behind."""
    beta, fmt = 0.9, codec.TopKFormat(2, 1, 1 / BLOCK)  # one value per block is sent
    delta = torch.full((BLOCK,), 0.01)
    delta[0] = 1.0  # always the largest: always selected
    feedback = codec.ErrorFeedback(decay=beta)
    for _ in range(200):
        intended = feedback.compensate(delta)
        assert torch.equal(intended, delta if feedback.residual is None else delta + beta * feedback.residual)
        scales = codec.agreed_scales([codec.block_maxabs(intended)], 2)
        feedback.record(intended, codec.encode(intended, 1.0, scales, 2, fmt).sent)
    assert torch.allclose(feedback.residual[1:], torch.full((BLOCK - 1,), 0.01 / (1 - beta)), rtol=1e-4)
    assert abs(float(feedback.residual[0])) <= float(scales[0]) / 2 + 1e-6


def test_top_k_error_feedback_carries_the_unselected_values_whole():
    x = torch.randn(BLOCK, generator=torch.Generator().manual_seed(3))
    fmt = codec.TopKFormat(2, 1, 0.01)
    scales = codec.agreed_scales([codec.block_maxabs(x).double() * 0.5], 2)
    enc = codec.encode(x, 0.5, scales, 2, fmt)
    assert int(enc.selected.sum()) == fmt.k(BLOCK) and bool((enc.codes[~enc.selected] == 0).all())
    assert torch.equal(enc.sent[~enc.selected], torch.zeros(int((~enc.selected).sum())))  # all of it rides along


@pytest.mark.parametrize("fmt", [codec.DenseFormat(4, 3), codec.TopKFormat(2, 3, 0.02)], ids=["int4", "topk"])
def test_the_averager_encodes_and_lands_piece_by_piece_with_the_bits_of_the_whole_vector(fmt):
    """No model-sized codes or sums: each piece is quantized (and top-k selected) on its own block scales as its
    stream asks, and each piece's sum is dequantized into the buffer as it comes: the same bits as the whole."""
    from p2pdiloco.protocol.merge import encode_piece as _encode_piece, land_piece as _land_piece
    from p2pdiloco.swarm.codes import PIECE, part_ranges, piece_ranges

    n = 2 * PIECE + 5 * codec.BLOCK + 123  # two parts of two pieces; the last piece ends inside a block
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    scales = codec.agreed_scales([codec.block_maxabs(x) * 0.7], fmt.bits)
    whole = codec.encode(x, 0.7, scales, fmt.bits, fmt, with_sent=False)
    pieces = [p for a, b in part_ranges(n, 2, align=codec.BLOCK) for p in piece_ranges(a, b)]
    assert len(pieces) == 4
    made = [_encode_piece(x, 0.7, scales, fmt.bits, fmt, a, b) for a, b in pieces]
    assert torch.equal(torch.cat([c for c, _ in made]), whole.codes)
    assert torch.equal(torch.cat([s for _, s in made]), whole.selected)
    out = torch.full((n,), float("nan"))
    for (a, b), (codes, _) in zip(pieces, made):
        _land_piece(out, scales, {"me": 0.7}, a, b, codes.to(torch.int64), frozenset())
    assert torch.equal(out, codec.dequantize(whole.codes, scales))


def test_an_island_merged_in_one_place_is_its_included_members_weighted_sum_on_the_groups_scales():
    """The simulator's island (sim.learners) and a peer's averager merge by the same arithmetic: the included
    members' codes on the scales from their clipped statistics times their weights, summed once, decoded once."""
    from p2pdiloco.protocol.island import IslandPlan
    from p2pdiloco.protocol.merge import group_scales, merged_in_one_place, wire_format
    from p2pdiloco.protocol.remote import Member

    n = 2 * codec.BLOCK + 17
    bodies = [torch.randn(n, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    members = [Member(peer=p, name=p, version=0, digest="00", tokens=1, steps=1, budget=1.0) for p in "abc"]
    plan = IslandPlan(weights=[0.6, 0.0, 0.4], deadline=1.0, maxabs=[codec.block_maxabs(b) for b in bodies])
    fmt = wire_format(20, 0.0, 3)
    assert type(fmt) is codec.DenseFormat and (fmt.bits, fmt.group_size) == (20, 3)
    topk = wire_format(2, 0.02, 3)
    assert isinstance(topk, codec.TopKFormat) and (topk.bits, topk.group_size, topk.fraction) == (2, 3, 0.02)
    merged, scales = merged_in_one_place(bodies, members, plan, 20, fmt)
    assert torch.equal(scales, codec.agreed_scales([codec.block_maxabs(bodies[0]).double() * 0.6,
                                                    codec.block_maxabs(bodies[2]).double() * 0.4], 20))
    assert torch.equal(scales, group_scales(plan, 20))
    assert torch.allclose(merged, 0.6 * bodies[0] + 0.4 * bodies[2], atol=1e-5)  # b's weight is 0: left out


def test_a_landed_piece_that_left_a_sender_out_is_the_others_weighted_mean():
    """A reducer that left a sender out sums the others' codes only: landing it scales the piece back from their
    weights to the weights' total, so the piece is the others' weighted mean, not a sum short of a member."""
    from p2pdiloco.protocol.merge import encode_piece, land_piece

    n = 3 * codec.BLOCK
    fmt = codec.DenseFormat(20, 3)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    scales = codec.agreed_scales([codec.block_maxabs(x) * w for x, w in zip(xs, weights.values())], fmt.bits)
    codes = [encode_piece(x, w, scales, fmt.bits, fmt, 0, n)[0].to(torch.int64) for x, w in zip(xs, weights.values())]
    without_b, whole = torch.empty(n), torch.empty(n)
    land_piece(without_b, scales, weights, 0, n, codes[0] + codes[2], frozenset({"b"}))
    land_piece(whole, scales, weights, 0, n, codes[0] + codes[2], frozenset())
    assert torch.equal(without_b, whole * torch.tensor(1.0 / 0.7, dtype=torch.float32))
    assert torch.allclose(without_b, (0.5 * xs[0] + 0.2 * xs[2]) / 0.7, atol=1e-4)


@pytest.mark.parametrize("width", [2, 3, 4, 6, 12, 20, 32])
def test_packing_a_slice_at_a_time_gives_the_bytes_of_packing_all_at_once(width):
    """pack/unpack run a slice at a time (the averager's peak memory); across slice boundaries the bytes and
    values are those of the whole part packed in one go."""
    n = 2 * codec.PACK_SLICE + 13
    limit = (1 << (width - 1)) - 1
    values = torch.randint(-limit, limit + 1, (n,), generator=torch.Generator().manual_seed(width))
    per, nbytes = codec._group(width)
    data = codec.pack(values, width)
    assert data == codec._pack_slice(values, width, per, nbytes)
    assert torch.equal(codec.unpack(data, width, n), values)


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_compensating_in_place_a_chunk_at_a_time_has_the_bits_of_the_whole_vector_sum(decay):
    """What the merger does to the averaging buffer (no model-sized compensated copy): Δ + β·residual, exactly."""
    gen = torch.Generator().manual_seed(3)
    n = 3 * _CHUNK + 5  # several chunks, a short last one
    delta, residual = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    feedback = codec.ErrorFeedback(residual=residual, decay=decay)
    buffer = delta.clone()
    feedback.compensate_(buffer)
    assert torch.equal(buffer, delta + (residual if decay == 1.0 else residual * decay))
    assert torch.equal(feedback.compensate(delta), buffer)


def _topk_part(indices_per_block, values_per_block, fmt):
    """A top-k part's raw payload from explicit (block-local) indices and values, as a liar might write it."""
    flat_idx = torch.tensor([i for block in indices_per_block for i in block], dtype=torch.int64)
    flat_val = torch.tensor([v for block in values_per_block for v in block], dtype=torch.int64)
    return bytes([codec.RAW]) + codec.pack(flat_idx - (1 << (codec.INDEX_WIDTH - 1)), codec.INDEX_WIDTH) + \
        codec.pack(flat_val, fmt.bits)


def test_a_top_k_part_with_indices_outside_their_block_or_not_increasing_is_refused_by_name():
    fmt = codec.TopKFormat(4, 2, 2 / 100)  # k = 2 in a block of 100
    assert torch.equal(fmt.decode(_topk_part([[3, 99]], [[1, -2]], fmt), 100)[[3, 99]], torch.tensor([1, -2],
                                                                                                     dtype=torch.int32))
    for indices in ([[3, 100]], [[5, 5]], [[7, 3]]):  # one past the block; twice the same; decreasing
        with pytest.raises(ValueError, match="^top-k indices out of their block or not strictly increasing$"):
            fmt.decode(_topk_part(indices, [[1, 1]], fmt), 100)
    one = codec.TopKFormat(4, 2, 1 / 100)  # k = 1: nothing to order
    assert one.decode(_topk_part([[99]], [[3]], one), 100)[99] == 3
    with pytest.raises(ValueError, match=r"^a top-k part of 100 values takes 8 bytes, got 2$"):  # 7 + 1
        one.decode(bytes([codec.RAW, 0, 0]), 100)


def test_a_sparse_sum_of_the_wrong_shape_is_refused_by_name():
    fmt = codec.TopKFormat(4, 2, 0.02)
    count_bytes = codec.packed_bytes(1, codec.COUNT_WIDTH)
    with pytest.raises(ValueError, match="^sparse sum too short for its counts$"):
        fmt.decode_sum(bytes([codec.RAW]) + b"\0" * (count_bytes - 1), 100)

    def sparse(count, indices, values):
        c = codec.pack(torch.tensor([count]) - (1 << (codec.COUNT_WIDTH - 1)), codec.COUNT_WIDTH)
        i = codec.pack(torch.tensor(indices) - (1 << (codec.INDEX_WIDTH - 1)), codec.INDEX_WIDTH)
        return bytes([codec.RAW]) + c + i + codec.pack(torch.tensor(values), codec.sum_width(4, 2))

    assert fmt.decode_sum(sparse(2, [0, 99], [5, -3]), 100)[[0, 99]].tolist() == [5, -3]
    full = sparse(100, list(range(100)), [1] * 100)  # every element of the block: allowed
    assert int(fmt.decode_sum(full, 100).sum()) == 100
    with pytest.raises(ValueError, match="^sparse sum indices out of their block$"):
        fmt.decode_sum(sparse(1, [100], [1]), 100)
    with pytest.raises(ValueError, match="^sparse sum of the wrong length$"):
        fmt.decode_sum(sparse(2, [0, 1], [1, 1])[:-1], 100)


def test_merge_weights_by_rule_and_their_refusals_by_name():
    from p2pdiloco.core.outer import merge_weights

    assert merge_weights([10, 0, 30], None, "uniform") == [0.5, 0.0, 0.5]  # a member with no tokens counts 0
    assert merge_weights([10, 20], [1, 1], "tokens2") == pytest.approx([0.2, 0.8])
    assert merge_weights([10, 20], [1, 0], "tokens2") == [1.0, 0.0]  # no steps: no weight
    with pytest.raises(ValueError, match="^tokens² / steps weighting needs the steps of every contribution$"):
        merge_weights([10, 20], [1], "tokens2")
    with pytest.raises(ValueError, match="^unknown weighting 'x'; choose one of "):
        merge_weights([10], [1], "x")
    with pytest.raises(ValueError, match="^cannot merge contributions that processed no tokens$"):
        merge_weights([0, 0], [1, 1], "uniform")
    assert codec.dequantize(torch.tensor([3]), torch.tensor([0.5])).dtype == torch.float32
    assert codec.quantize(torch.tensor([1.0]), torch.tensor([0.5]), 4).dtype == torch.int32


def test_empty_parts_and_all_zero_sums_round_trip_and_a_sparse_count_past_its_block_is_refused():
    fmt = codec.TopKFormat(4, 2, 0.02)
    empty = torch.zeros(0, dtype=torch.int64)
    assert fmt.decode(fmt.encode(empty, torch.zeros(0, dtype=torch.bool)), 0).numel() == 0
    assert fmt.decode_sum(fmt.encode_sum(empty), 0).numel() == 0
    zeros = torch.zeros(100, dtype=torch.int64)  # a sum where every sender's codes cancelled: no entry at all
    assert torch.equal(fmt.decode_sum(fmt.encode_sum(zeros), 100).long(), zeros)
    # the second block (100 values) claims 101 entries, every index inside it: refused, as in the first block
    n, width = codec.BLOCK + 100, codec.sum_width(4, 2)
    counts = codec.pack(torch.tensor([0, 101]) - (1 << (codec.COUNT_WIDTH - 1)), codec.COUNT_WIDTH)
    indices = codec.pack(torch.arange(101) % 100 - (1 << (codec.INDEX_WIDTH - 1)), codec.INDEX_WIDTH)
    crafted = bytes([codec.RAW]) + counts + indices + codec.pack(torch.ones(101, dtype=torch.int64), width)
    with pytest.raises(ValueError, match="^sparse sum indices out of their block$"):
        fmt.decode_sum(crafted, n)


def test_more_edges_the_mutants_found():
    """Each assertion fails on a one-line change that every other test let pass (scripts/bench/mutation.sh)."""
    # int2's statistic of a block holding one selected value is that value's size, not half of it
    assert codec.DenseFormat(2, 1).block_statistic(torch.tensor([-4.0])).tolist() == [4.0]
    # a member merged at weight 0 carries nothing (no division by its weight)
    assert codec.sent_of(torch.tensor([3, -1], dtype=torch.int32), torch.tensor([0.5]), 0.0).tolist() == [0.0, 0.0]
    # top-k indices must increase throughout, not only past the first; in every block, not only the first
    fmt = codec.TopKFormat(4, 2, 3 / 100)  # k = 3 in a block of 100
    with pytest.raises(ValueError, match="not strictly increasing"):
        fmt.decode(_topk_part([[1, 5, 3]], [[1, 1, 1]], fmt), 100)
    two = codec.TopKFormat(4, 2, 1 / 100)  # k = 1 in the second block, of 100 values
    n = codec.BLOCK + 100
    k_first = two.k(codec.BLOCK)
    bad = _topk_part([list(range(k_first)), [100]], [[1] * k_first, [1]], two)  # 100: one past the second block
    with pytest.raises(ValueError, match="out of their block"):
        two.decode(bad, n)
