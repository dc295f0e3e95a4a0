"""Exact weighted sums: integer codes on agreed block scales, the same bits on every member whatever the order."""

import itertools

import torch

from p2pdiloco.core import codec, exact
from p2pdiloco.core.outer import merge_weights, weighted_merge


def hivemind_reduce(parts, weights, order):
    """What hivemind's own reducer (hivemind.averaging.partition.TensorPartReducer, which its butterfly
    all-reduce runs for each part) returns when the members' parts arrive in `order`: fp32 adds, as they come."""
    import asyncio

    from hivemind.averaging.partition import TensorPartReducer

    async def reduce():
        reducer = TensorPartReducer([parts[0].shape], len(parts))
        tasks = [asyncio.create_task(reducer.accumulate_part(i, 0, parts[i], weight=weights[i])) for i in order]
        return (await asyncio.gather(*tasks))[0].clone()

    return asyncio.run(reduce())


def exact_merge(deltas, weights, bits: int = codec.BITS["none"], order=None) -> torch.Tensor:
    """Σ wᵢΔᵢ as a round computes it: each member's codes on the agreed scales, summed as integers in `order`
    (a reducer adds them as they come), dequantized once."""
    scales = codec.agreed_scales([exact.block_maxabs(d) * w for d, w in zip(deltas, weights)], bits)
    codes = [codec.quantize(d, scales, bits, w).to(torch.int64) for d, w in zip(deltas, weights)]
    total = torch.zeros_like(codes[0])
    for i in order or range(len(codes)):
        total += codes[i]
    return codec.dequantize(total, scales)


def make_deltas(n_members=4, n=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 1e-3 * (i + 1) for i in range(n_members)]


def test_hivemind_averages_are_not_the_same_bits_in_another_arrival_order_and_exact_sums_are():
    """Why the project sums integer codes: hivemind's reducer adds fp32 parts in the order they arrive, and two
    orders give two averages that differ in their last bits (one reducer per part, so members would disagree
    where parts came in other orders, and their states would drift apart bit by bit)."""
    deltas, weights = make_deltas(), [1.0, 2.0, 3.0, 0.5]
    orders = list(itertools.permutations(range(4)))[:6]
    averages = [hivemind_reduce(deltas, weights, order) for order in orders]
    assert not all(torch.equal(averages[0], a) for a in averages[1:])
    assert all(torch.allclose(averages[0], a, rtol=1e-5, atol=1e-9) for a in averages[1:])  # equal but for rounding
    exact_sums = [exact_merge(deltas, [w / sum(weights) for w in weights], order=order) for order in orders]
    assert all(torch.equal(exact_sums[0], e) for e in exact_sums[1:])


def test_exact_sum_is_the_same_bits_in_any_order_and_matches_the_weighted_mean():
    deltas, tokens = make_deltas(), [1000, 2000, 3000, 500]
    weights = merge_weights(tokens)
    merged = [exact_merge(deltas, weights, order=order) for order in itertools.permutations(range(4))]
    assert all(torch.equal(merged[0], m) for m in merged[1:])
    reference = weighted_merge(deltas, weights)
    assert (merged[0] - reference).norm() / reference.norm() < 1e-5
    # the default codes are finer than int8's by far: what they drop is ~2^-20 of each block's maximum
    coarse = exact_merge(deltas, weights, bits=8)
    assert (merged[0] - reference).norm() < (coarse - reference).norm() / 1000


def test_chunked_arithmetic_gives_the_bits_of_the_whole_model_sized_formula():
    """quantize and dequantize run a few MB at a time (a peer's peak memory); across chunk boundaries they must
    give exactly the bits of the one-shot float64 formula every peer used before."""
    from p2pdiloco.core import codec

    n = 2 * exact._CHUNK + 3 * exact.BLOCK + 77
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(n, generator=g) * 1e-3
    limit = codec.levels(codec.BITS["none"])
    scales = exact.scales_for([exact.block_maxabs(delta), exact.block_maxabs(delta) * 0.5], limit)
    per_element = scales.repeat_interleave(exact.BLOCK)[:n]
    q = exact.quantize(delta, 0.37, scales, limit)
    assert torch.equal(q, torch.round(delta.double() * 0.37 / per_element).clamp_(-limit, limit).float())
    assert torch.equal(exact.dequantize(q, scales), (q.double() * per_element).float())
    scales4 = codec.agreed_scales([codec.block_maxabs(delta)], 4)
    codes = codec.quantize(delta, scales4, 4, 0.5)
    per4 = scales4.double().repeat_interleave(exact.BLOCK)[:n]
    assert torch.equal(codes, (delta.double() * 0.5 / per4).round().clamp(-7, 7).to(torch.int32))
    assert torch.equal(codec.dequantize(codes, scales4), (codes.double() * per4).float())
    # the block maxima, error feedback's `sent` and its residual: chunked too, the same bits as one shot
    padded = torch.nn.functional.pad(delta.abs(), (0, -n % exact.BLOCK)).view(-1, exact.BLOCK)
    assert torch.equal(exact.block_maxabs(delta), padded.amax(dim=1))
    sent = codec.sent_of(codes, scales4, 0.5)
    assert torch.equal(sent, codec.dequantize(codes, scales4).double().div_(0.5).float())
    feedback = codec.ErrorFeedback()
    feedback.record(delta, sent)
    assert torch.equal(feedback.residual, (delta.double() - sent.double()).float())


def test_finiteness_is_checked_a_chunk_at_a_time_and_finds_any_nan_or_infinity():
    """A round's merged update (and a downloaded state) is checked for NaN/∞ at a round's end, when a peer's memory
    peaks: `torch.isfinite` of the whole vector made model-sized temporaries (|x| as floats and bool masks, ~5
    B/param). Chunked, the peak grows by a chunk's worth, and a bad value anywhere, even in the last chunk or a
    second tensor, is still found."""
    from tests.harness.memory import PeakGrowth

    n = 3 * exact._CHUNK + 5
    x, y = torch.zeros(n), torch.zeros(7)
    for where, bad in ((0, float("nan")), (n - 1, float("inf")), (exact._CHUNK, float("-inf"))):
        x[where] = bad
        assert not exact.all_finite(x) and not exact.all_finite(y, x)
        x[where] = 0.0
    assert exact.all_finite(x, y)
    y[6] = float("nan")
    assert not exact.all_finite(x, y)
    grew = PeakGrowth()
    big = torch.zeros(16 * exact._CHUNK)  # 67 MB: |big| alone would be as much again
    with grew:
        assert exact.all_finite(big)
    assert grew.bytes < big.numel(), f"peak grew by {grew.bytes / 1e6:.1f} MB checking {big.numel() / 1e6:.0f} M values"
