"""The exact all-reduce encoding, driven through a simulation of hivemind's fp32 arithmetic."""

import torch

from p2pdiloco.core import exact
from p2pdiloco.core.outer import merge_weights, weighted_merge


def hivemind_like_allreduce(buffers, drop_sender_from=None):
    """What hivemind's butterfly all-reduce hands each member: local + fl(mean − local), all in fp32.
    drop_sender_from=(sender, start): that sender's values are missing from elements >= start."""
    stacked = torch.stack(buffers)
    n_members = len(buffers)
    if drop_sender_from is None:
        mean = stacked.sum(0) / n_members
    else:
        sender, start = drop_sender_from
        mean = stacked.sum(0) / n_members
        others = torch.cat([stacked[:sender], stacked[sender + 1:]])
        mean[start:] = others[:, start:].sum(0) / (n_members - 1)
    return [b + (mean - b) for b in buffers]


def encode_group(deltas, tokens, group_id=b"group-1", max_group=8):
    weights = merge_weights(tokens)
    maxabs = [exact.block_maxabs(d) for d in deltas]
    return [exact.encode(d, w, maxabs, i, group_id, exact.tail_size(max_group)) for i, (d, w) in
            enumerate(zip(deltas, weights))]


def make_deltas(n_members=4, n=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 1e-3 * (i + 1) for i in range(n_members)]


def test_naive_fp32_average_is_not_bitwise_equal_across_members():
    deltas = make_deltas()
    results = hivemind_like_allreduce(deltas)
    assert not all(torch.equal(results[0], r) for r in results[1:])


def test_exact_sum_is_bitwise_equal_verified_and_matches_weighted_mean():
    deltas, tokens = make_deltas(), [1000, 2000, 3000, 500]
    encoded = encode_group(deltas, tokens)
    results = hivemind_like_allreduce([e.buffer for e in encoded])
    decoded = [exact.decode(r, deltas[0].numel(), len(deltas), e) for r, e in zip(results, encoded)]
    assert all(d.verified for d in decoded), [d.reason for d in decoded]
    assert all(torch.equal(decoded[0].merged, d.merged) for d in decoded[1:])
    reference = weighted_merge(deltas, merge_weights(tokens))
    rel = (decoded[0].merged - reference).norm() / reference.norm()
    assert rel < 1e-4, rel


def test_kept_local_part_fails_verification():
    deltas, tokens = make_deltas(), [1, 1, 1, 1]
    encoded = encode_group(deltas, tokens)
    results = hivemind_like_allreduce([e.buffer for e in encoded])
    results[2][:100] = encoded[2].buffer[:100]  # a reducer died: member 2 keeps its own values there
    decoded = exact.decode(results[2], deltas[0].numel(), 4, encoded[2])
    assert not decoded.verified and "checksum" in decoded.reason


def test_part_averaged_without_a_dropped_sender_fails_verification():
    deltas, tokens = make_deltas(), [5, 1, 1, 1]
    encoded = encode_group(deltas, tokens)
    results = hivemind_like_allreduce([e.buffer for e in encoded], drop_sender_from=(1, 30_000))
    decoded = exact.decode(results[0], deltas[0].numel(), 4, encoded[0])
    assert not decoded.verified


def test_a_member_that_received_nothing_from_the_others_fails_verification():
    """Seen in a chaos run: both members of an island of two got back only their own reducer's part, that
    part reduced over themselves alone, and kept their own values everywhere else. Such a result is N copies
    of the member's own buffer: every element is an integer and the checksum tail is consistent with it, so
    only the members' presence markers show that the others' shares are missing."""
    deltas, tokens = make_deltas(2), [1, 1]
    encoded = encode_group(deltas, tokens)
    for member, enc in enumerate(encoded):
        kept_local = enc.buffer.clone()  # hivemind's "received 44.9% results": nothing of the other arrived
        decoded = exact.decode(kept_local, deltas[0].numel(), 2, enc)
        assert not decoded.verified and "missing" in decoded.reason, decoded.reason


def test_a_tail_reduced_without_a_member_fails_verification():
    deltas, tokens = make_deltas(3), [1, 2, 3]
    encoded = encode_group(deltas, tokens)
    results = hivemind_like_allreduce([e.buffer for e in encoded])
    n = deltas[0].numel()
    # the part holding the tail was reduced over members 0 and 1 only (member 2 dropped as a sender)
    partial = (encoded[0].buffer[n:] + encoded[1].buffer[n:]) / 2
    results[0][n:] = encoded[0].buffer[n:] + (partial - encoded[0].buffer[n:])
    decoded = exact.decode(results[0], n, 3, encoded[0])
    assert not decoded.verified


def test_group_of_one_returns_its_own_delta():
    delta = make_deltas(1)[0]
    (enc,) = encode_group([delta], [7])
    decoded = exact.decode(hivemind_like_allreduce([enc.buffer])[0], delta.numel(), 1, enc)
    assert decoded.verified
    assert (decoded.merged - delta).abs().max() <= exact.block_maxabs(delta).max() / exact.levels(1)


def test_checksum_roundtrip_through_limbs():
    for value in (0, 1, -1, 2**61, -(2**61), 123456789012345):
        assert exact.decode_checksum(exact.encode_checksum(value)) == value


def test_chunked_arithmetic_gives_the_bits_of_the_whole_model_sized_formula():
    """quantize/dequantize/recover_sum run a few MB at a time (a peer's peak memory); across chunk boundaries
    they must give exactly the bits of the one-shot float64 formula every peer used before."""
    from p2pdiloco.core import codec

    n = 2 * exact._CHUNK + 3 * exact.BLOCK + 77
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(n, generator=g) * 1e-3
    scales = exact.group_scales([exact.block_maxabs(delta), exact.block_maxabs(delta) * 0.5], 2)
    per_element = scales.repeat_interleave(exact.BLOCK)[:n]
    q = exact.quantize(delta, 0.37, scales, exact.levels(2))
    assert torch.equal(q, torch.round(delta.double() * 0.37 / per_element).clamp_(-exact.levels(2), exact.levels(2)).float())
    assert torch.equal(exact.dequantize(q, scales), (q.double() * per_element).float())
    total, worst = exact.recover_sum(q / 2, 2)
    assert torch.equal(total, q) and worst == 0.0
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
