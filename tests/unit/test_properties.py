"""Property tests (hypothesis) of the invariants the swarm stands on, over inputs no one wrote by hand: codes
and sums round-trip; exact sums have the same bits in any order; an honest member never breaks its claims, in
any island; merge weights sum to one and keep every bound; the parsers never raise on any bytes or values; a
round never commits onto a state other than the one the island's merge was applied to. Derandomized (the same
examples on every run: tests/conftest.py), so a failure reproduces."""

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.core import codec, exact
from p2pdiloco.core.claims import claims_in_codes, sum_why_not
from p2pdiloco.protocol.island import cap_to_median, cut_to_median_norm, lower_median, member_weights, plan_island
from p2pdiloco.protocol.outcomes import Committed
from p2pdiloco.protocol.remote import Expect, Malformed, parse_island, parse_member, parse_peer_record
from p2pdiloco.protocol.round import Done, Download
from tests.unit.test_protocol import ME, member, new_round, record, reduced, to_island

BLOCK = codec.BLOCK
WIDTHS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32]
FORMATS = st.sampled_from([codec.DenseFormat(2, 3), codec.DenseFormat(4, 2), codec.DenseFormat(8, 5),
                           codec.DenseFormat(20, 4), codec.TopKFormat(2, 3, 0.02), codec.TopKFormat(4, 4, 0.05),
                           codec.TopKFormat(8, 2, 1.0)])


def vector(seed: int, n: int, scale: float = 1.0) -> torch.Tensor:
    """Heavy-tailed values (a Student-t-like ratio of normals), as real pseudo-gradients are."""
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, generator=g) / torch.randn(n, generator=g).abs().clamp(min=0.05)


# ---- encode / decode ------------------------------------------------------------------------------------------
@given(width=st.sampled_from(WIDTHS), n=st.integers(0, 300), seed=st.integers(0, 2 ** 31))
def test_packed_values_of_any_width_unpack_to_themselves(width, n, seed):
    top = 1 << (width - 1)
    values = torch.randint(-top, top, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    assert torch.equal(codec.unpack(codec.pack(values, width), width, n).long(), values)


@given(fmt=FORMATS, blocks=st.integers(0, 2), tail=st.integers(0, 700), seed=st.integers(0, 2 ** 31))
def test_a_members_codes_and_a_groups_sum_decode_to_what_was_encoded(fmt, blocks, tail, seed):
    n = blocks * BLOCK + tail
    assume(n > 0)
    x = vector(seed, n)
    scales = codec.agreed_scales([codec.block_maxabs(x)], fmt.bits)
    enc = codec.encode(x, 1.0, scales, fmt.bits, fmt, with_sent=False)
    assert torch.equal(fmt.decode(fmt.encode(enc.codes, enc.selected), n), enc.codes)
    total = enc.codes.long() * min(fmt.group_size, 2)  # a sum the group's width must hold
    assert torch.equal(fmt.decode_sum(fmt.encode_sum(total), n).long(), total)


# ---- exact sums -----------------------------------------------------------------------------------------------
@given(members=st.integers(2, 6), n=st.integers(1, 3000), seed=st.integers(0, 2 ** 31),
       bits=st.sampled_from([4, 8, 20]), order=st.randoms(use_true_random=False))
def test_an_exact_sum_has_the_same_bits_in_any_order(members, n, seed, bits, order):
    deltas = [vector(seed + i, n, scale=10.0 ** (i % 5 - 3)) for i in range(members)]
    weights = [1.0 / (i + 1) for i in range(members)]
    scales = codec.agreed_scales([exact.block_maxabs(d) * w for d, w in zip(deltas, weights)], bits)
    codes = [codec.quantize(d, scales, bits, w).to(torch.int64) for d, w in zip(deltas, weights)]
    shuffled = list(range(members))
    order.shuffle(shuffled)
    one, other = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    for i, j in zip(range(members), shuffled):
        one += codes[i]
        other += codes[j]
    assert torch.equal(codec.dequantize(one, scales), codec.dequantize(other, scales))
    merged = sum(w * d for w, d in zip(weights, deltas))  # within half a step per member of the fp64 sum
    err = (codec.dequantize(one, scales).double() - merged.double()).abs()
    step = scales.double().repeat_interleave(BLOCK)[:n]
    assert bool((err <= members * step / 2 * (1 + 1e-6) + 1e-30).all())


# ---- claims ---------------------------------------------------------------------------------------------------
N_CLAIMS = 2 * BLOCK + 77


@given(scales=st.lists(st.floats(-6, 3), min_size=1, max_size=5), tokens=st.lists(st.integers(1, 10 ** 6), min_size=5,
       max_size=5), fmt=FORMATS, seed=st.integers(0, 2 ** 31), versions=st.lists(st.integers(1, 3), min_size=5,
       max_size=5))
def test_an_honest_member_never_breaks_its_claims_in_any_island(scales, tokens, fmt, seed, versions):
    """Any Δs (sizes 10⁻⁶ to 10³ apart, heavy-tailed), any tokens, versions and wire format: the island bounds
    the claims, and each honest member's codes, and their sum, stay within them."""
    from p2pdiloco.core.claims import block_norms

    deltas = [vector(seed + i, N_CLAIMS, 10.0 ** s) for i, s in enumerate(scales)]
    records = [dict(peer=f"p{i}", name=f"p{i}", version=versions[i], digest="abcdef", tokens=tokens[i], steps=32,
                    budget=10.0, norms=[], maxabs=fmt.block_statistic(d).numpy().tobytes(),
                    block_norms=block_norms(d).numpy().tobytes()) for i, d in enumerate(deltas)]
    plan = plan_island(parse_island(records, Expect(N_CLAIMS)), "tokens2", 60.0, N_CLAIMS)
    included = [i for i in plan.included if plan.weights[i] > 0]
    assume(included)
    limit, maxima = codec.levels(fmt.bits), codec.levels(fmt.bits) > 1
    scales_ = codec.agreed_scales([plan.maxabs[i].double() * plan.weights[i] for i in included], fmt.bits)
    total = torch.zeros(N_CLAIMS, dtype=torch.int64)
    claims = []
    for i in included:
        codes = codec.encode(deltas[i], plan.weights[i], scales_, fmt.bits, fmt, with_sent=False).codes
        claim = claims_in_codes(plan.maxabs[i], plan.clipped[i], plan.norms[i], plan.weights[i], scales_, limit,
                                maxima)
        assert claim.why_not(codes, 0) == "", (i, claim.why_not(codes, 0))
        total += codes
        claims.append(claim)
    assert sum_why_not(total, 0, claims) == ""


# ---- merge weights --------------------------------------------------------------------------------------------
# 0 or normal floats: a subnormal weight (as hypothesis draws, once in ~16 runs) has too few significant bits for
# a ratio to hold to 1e-9, and no merge weight is one
WEIGHTS = st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e6)), min_size=1, max_size=8).filter(lambda w: sum(w) > 0)


@given(weights=WEIGHTS, ratio=st.floats(1.0, 10.0))
def test_capped_weights_sum_to_one_and_none_exceeds_ratio_times_the_median(weights, ratio):
    normal = [w / sum(weights) for w in weights]
    capped, _ = cap_to_median(normal, ratio)
    assert math.isclose(sum(capped), 1.0, rel_tol=1e-9) and min(capped) >= 0
    if len(capped) > 1:
        assert max(capped) <= ratio * lower_median([w for w in capped if w > 0]) * (1 + 1e-9)


@given(weights=WEIGHTS, norms=st.lists(st.floats(1e-6, 1e6), min_size=8, max_size=8), ratio=st.floats(1.0, 10.0))
def test_a_norm_cut_scales_each_outlier_to_the_bound_and_leaves_the_others_alone(weights, norms, ratio):
    weights = [w / sum(weights) for w in weights]
    norms = norms[:len(weights)]
    cut, notes = cut_to_median_norm(weights, norms, ratio)
    assert all(cut[j] == weights[j] for j in range(len(weights)) if j not in notes)
    if len(weights) < 2:
        return
    bound = ratio * lower_median(norms)
    kept = [j for j in range(len(weights)) if norms[j] <= bound and weights[j] > 0]
    for i in range(len(weights)):
        if norms[i] > bound and weights[i] > 0 and kept:  # its share, relative to an uncut one, × bound / norm
            j = kept[0]
            assert math.isclose(cut[i] / cut[j], weights[i] / weights[j] * bound / norms[i], rel_tol=1e-9)
            assert i in notes


@given(tokens=st.lists(st.integers(0, 10 ** 9), min_size=1, max_size=8), data=st.data())
def test_member_weights_bound_what_each_adds_sum_to_one_unless_a_long_member_is_cut_and_discount_the_stale(
        tokens, data):
    import dataclasses

    from p2pdiloco.config import OuterConfig
    from p2pdiloco.protocol.island import Bounds

    assume(any(tokens))
    n = len(tokens)
    steps = [max(1, t // 128) for t in tokens]
    norms = data.draw(st.lists(st.floats(1e-3, 1e3), min_size=n, max_size=n))
    bounds = dataclasses.replace(Bounds.of(OuterConfig()), stale_factor=1.0)  # a peer's, but for the stale discount
    same, notes = member_weights(tokens, steps, norms, [4] * n, "tokens2", bounds)
    assert min(same) >= 0
    products = [w * x for w, x in zip(same, norms)]
    if sum(x > 0 for x in products) >= 2:
        assert max(products) <= bounds.influence_ratio * lower_median([x for x in products if x > 0]) * (1 + 1e-9)
    if not any("the bound of" in why for _, why in notes):  # what a long member loses goes to nobody; else, to all
        assert math.isclose(sum(same), 1.0, rel_tol=1e-9)
    versions = data.draw(st.lists(st.integers(2, 4), min_size=n, max_size=n))
    stale, _ = member_weights(tokens, steps, norms, versions, "tokens2", dataclasses.replace(bounds, stale_factor=0.5))
    newest = max(versions)
    for w, s, v in zip(same, stale, versions):
        assert math.isclose(s, w * 0.5 ** (newest - v), rel_tol=1e-9, abs_tol=1e-300)


# ---- the parsers ----------------------------------------------------------------------------------------------
@given(fmt=FORMATS, n=st.integers(1, 3000), data=st.data())
def test_a_part_or_sum_of_any_bytes_parses_within_its_range_or_raises_value_error(fmt, n, data):
    """Bytes of a part's exact length (so that they parse, mostly), or of any length: what parses has the part's
    shape, a part's codes lie within ±L, and a sum's values within its width."""
    dense_bytes = codec.packed_bytes(n, fmt.bits)
    raw = data.draw(st.binary(min_size=dense_bytes, max_size=dense_bytes) | st.binary(max_size=600))
    sent = data.draw(st.sampled_from([bytes([codec.RAW]) + raw, raw]))
    for decode, bound in ((fmt.decode, codec.levels(fmt.bits)),
                          (fmt.decode_sum, 1 << (codec.sum_width(fmt.bits, fmt.group_size) - 1))):
        try:
            out = decode(sent, n)
        except ValueError:
            continue
        assert out.shape == (n,) and out.dtype == torch.int32
        assert int(out.abs().max()) <= bound


VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80) |
                      st.binary(max_size=80),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                   max_size=6), max_leaves=20)
MEMBER_KEYS = ["peer", "name", "version", "digest", "tokens", "steps", "budget", "norms", "maxabs", "block_norms",
               "blame", "pass"]


@given(blob=st.binary(max_size=400))
def test_a_record_of_any_bytes_never_raises_out_of_the_parsers(blob):
    try:
        value = MSGPackSerializer.loads(blob)
    except Exception:
        return  # hivemind's own decoder refuses it first
    parse_peer_record(value)
    island = parse_island([value], Expect(1000))
    assert len(island.members) == 1


TRICKY = st.sampled_from(["abcd", [1.0, 2.0, 3.0, 4.0], b"\0\0\0\0", b"\0\0\xc0\x7f", 2 ** 63, -1, math.nan,
                          {"k": 1}, True, "x" * 200])  # right length, wrong type; a NaN as fp32; out of range


@given(changes=st.dictionaries(st.sampled_from(MEMBER_KEYS + ["junk"]), VALUES | TRICKY, min_size=1, max_size=3))
def test_a_record_of_any_values_is_a_member_or_malformed(changes):
    """A well-formed record with 1-3 of its fields replaced by anything: a member whose fields have their types,
    or Malformed; nothing else is raised."""
    good = dict(peer="12D3KooWp", name="p", version=3, digest="abcdef", tokens=4096, steps=32, budget=10.0, norms=[],
                maxabs=b"\0\0\x80\x3f", block_norms=b"\0\0\x80\x3f")
    try:
        m = parse_member({**good, **changes}, Expect(1000))
    except Malformed:
        return
    assert isinstance(m.version, int) and isinstance(m.maxabs, bytes) and len(m.maxabs) == 4
    assert isinstance(m.block_norms, bytes) and isinstance(m.budget, float) and isinstance(m.credential, bytes)


# ---- the round ------------------------------------------------------------------------------------------------
KEYS = st.tuples(st.integers(1, 5), st.sampled_from(["000000", "aaaaaa", "bbbbbb", "ffffff"]))


@given(others=st.lists(KEYS, min_size=1, max_size=4))
def test_a_round_commits_only_onto_the_state_the_islands_merge_was_applied_to(others):
    """Ours is (3, aaaaaa); the island's merge is applied to its members' highest (version, digest). Where that
    is not ours we fetch that state (a Download) and never commit the merge onto our own."""
    rnd = new_round()
    to_island(rnd, [record("p0", ready=3)])
    members = [member(f"p{i}", version=v, digest=d) for i, (v, d) in enumerate(others)]
    decision = rnd.on_island(reduced(member(ME), *members), 110.0)
    newest = max([(3, "aaaaaa"), *others])
    if newest == (3, "aaaaaa"):
        assert isinstance(decision, Done) and isinstance(decision.outcome, Committed)
    else:
        assert decision == Download(newest[0] + 1, "stale contribution")
