"""Every sender's codes are checked against what it claimed (p2pdiloco.core.claims): exact for honest members,
whatever their Δs look like beside the others', and broken by a liar that claims honest statistics."""

import dataclasses

import pytest
import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.core import codec, exact
from p2pdiloco.core.claims import block_norms, claims_in_codes, sum_why_not
from p2pdiloco.protocol.island import Bounds, plan_island
from p2pdiloco.protocol.remote import Expect, parse_island

N = 6 * codec.BLOCK + 123  # a short last block too


def record(peer: str, delta: torch.Tensor, tokens: int = 4096, steps: int = 32, claimed=None,
           statistic=exact.block_maxabs) -> dict:
    """What gather_record sends: `statistic` is the wire format's (the maximum, or int2's mean |value|)."""
    claimed = delta if claimed is None else claimed
    return dict(peer=peer, name=peer, version=3, digest="abcdef", tokens=tokens, steps=steps, budget=10.0,
                norms=[], maxabs=statistic(claimed).numpy().tobytes(),
                block_norms=block_norms(claimed).numpy().tobytes())


def deltas(scales, seed=0):
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(N, generator=g)
    return [s * (common + 0.7 * torch.randn(N, generator=g)) for s in scales]


def island_codes(records, sent, bits: int, fmt=None, bounds=Bounds()):
    """Each member's codes as it would send them (`sent`: what it actually encodes), and its claims (held to the
    claimed norm from below too on dense formats, as a peer's reducers hold them)."""
    plan = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N, bounds)
    included = plan.included
    scales = codec.agreed_scales([plan.maxabs[i].double() * plan.weights[i] for i in included], bits)
    limit, maxima = codec.levels(bits), codec.levels(bits) > 1
    codes = [codec.encode(sent[i], plan.weights[i], scales, bits, fmt, with_sent=False).codes for i in included]
    floor = fmt is None
    claims = [claims_in_codes(plan.maxabs[i], plan.clipped[i], plan.norms[i], plan.weights[i], scales, limit, maxima,
                              plan.backing[i] if floor else None) for i in included]
    return plan, codes, claims


def problems(codes, claims, parts: int = 3) -> list[str]:
    """Each member's codes checked the way reducers see them: in block-aligned parts."""
    out = []
    for c, claim in zip(codes, claims):
        for start, end in codec_parts(parts):
            out.append(claim.why_not(c[start:end], start))
    return out


def codec_parts(parts: int):
    from p2pdiloco.swarm.codes import part_ranges

    return part_ranges(N, parts, align=codec.BLOCK)


NONE = codec.BITS["none"]
FORMATS = [(NONE, None), (8, None), (4, None), (2, None), (2, codec.TopKFormat(2, 4, 0.1))]


@pytest.mark.parametrize("bits, fmt", FORMATS)
@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (1, 1, 1, 5), (1, 20), (20, 1), (1, 1, 0), (3, 1, 0.2)])
def test_honest_members_meet_their_claims_exactly_however_their_deltas_differ(bits, fmt, sizes):
    """Among them: a member whose Δ is 5× the others' (left out at 5 % saturation in a clean run), and a veteran
    beside a fresh joiner, 20× apart, in a 2-member island (refused every round by the saturation test CI
    caught); their maxima are clipped and their weights cut, and they are still merged."""
    xs = deltas(sizes)
    statistic = (fmt or codec.DenseFormat(bits, 1)).block_statistic
    records = [record(f"p{i}", x, statistic=statistic) for i, x in enumerate(xs)]
    plan, codes, claims = island_codes(records, xs, bits, fmt)
    assert problems(codes, claims) == [""] * len(codes) * 3
    assert len(plan.included) == len(sizes)


@pytest.mark.parametrize("bits", [NONE, 8, 4])
def test_a_liar_claiming_honest_statistics_is_caught_scaled_or_sign_saturated(bits):
    """×100 its Δ, or every code at the range's edge in its Δ's signs, while claiming its honest maxima and
    norms (and 1000× its tokens): its codes leave its claims in every part."""
    xs = deltas((1, 1, 1, 1), seed=2)
    records = [record(f"h{i}", x) for i, x in enumerate(xs[:3])] + [record("evil", xs[3], tokens=4096 * 1000)]
    for lie in (xs[3] * 100, xs[3].sign() * 1e6):
        _, codes, claims = island_codes(records, xs[:3] + [lie], bits)
        found = problems(codes, claims)
        assert found[:9] == [""] * 9 and all(found[9:]), found[9:]


@pytest.mark.parametrize("bits", [NONE, 8, 4])
def test_a_near_zero_update_that_claims_a_typical_norm_is_caught_and_one_that_claims_its_own_counts_for_little(bits):
    """Dilution: 1000× its tokens for a Δ a thousandth of the others'. Claiming an honest member's statistics, its
    codes fall short of the norm it claimed, in every part; claiming its own (the claims true of the lie), it is
    merged, but its weight is cut by how short its Δ is (cut_below_median_norm), so it takes no weight from the
    honest members. Without that cut the weight cap alone lets it hold 40 % of the merge."""
    xs = deltas((1, 1, 1, 1), seed=6)
    tiny = xs[3] * 1e-3
    honest = [record(f"h{i}", x) for i, x in enumerate(xs[:3])]
    _, codes, claims = island_codes(honest + [record("evil", xs[3], tokens=4096 * 1000)], xs[:3] + [tiny], bits)
    found = problems(codes, claims)
    assert found[:9] == [""] * 9 and all("short of" in why for why in found[9:]), found[9:]
    consistent = honest + [record("evil", tiny, tokens=4096 * 1000)]
    plan, codes, claims = island_codes(consistent, xs[:3] + [tiny], bits, bounds=Bounds.of(OuterConfig()))
    assert problems(codes, claims) == [""] * 12
    assert plan.weights[3] < 0.01 and "floor" in plan.bounded[3]
    unfloored = plan_island(parse_island(consistent, Expect(N)), "tokens2", 60.0, N,
                            dataclasses.replace(Bounds.of(OuterConfig()), floor_ratio=0))
    assert unfloored.weights[3] == pytest.approx(0.4, abs=0.005)


def test_a_liar_whose_maxima_were_clipped_is_held_by_the_norm_it_claimed():
    """It claims honest norms but maxima 10× larger (so they are clipped and its codes may reach ±L everywhere)
    and sends ×100: the maxima cannot tell, its norm can."""
    xs = deltas((1, 1, 1, 1), seed=4)
    claimed = xs[3].clone()
    claimed[:: codec.BLOCK] = 100.0  # one element per block: its maxima ~15× the others', its norms +13 %
    records = [record(f"h{i}", x) for i, x in enumerate(xs[:3])] + [record("evil", xs[3], claimed=claimed)]
    plan, codes, claims = island_codes(records, xs[:3] + [xs[3] * 100], 4)
    assert bool(plan.clipped[3].all())
    found = problems(codes, claims)
    assert found[:9] == [""] * 9 and all("norm" in why for why in found[9:]), found[9:]


def test_a_liar_claiming_huge_statistics_has_its_weight_cut_so_its_delta_counts_like_a_typical_one():
    xs = deltas((1, 1, 1, 1), seed=5)
    lie = xs[3] * 100
    records = [record(f"h{i}", x) for i, x in enumerate(xs[:3])] + [record("evil", lie, tokens=4096 * 1000)]
    plan, codes, claims = island_codes(records, xs[:3] + [lie], 4)
    assert problems(codes, claims) == [""] * 12  # it sends what it claims: nothing to refuse
    norm = lambda i, x: plan.weights[i] * float(x.norm())  # noqa: E731
    honest = sorted(norm(i, xs[i]) for i in range(3))
    bounds = Bounds()
    assert norm(3, lie) <= bounds.weight_ratio * bounds.norm_ratio * honest[1] * 1.01
    assert "weight cut" in plan.bounded[3]
    unbounded = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N, Bounds(2.0, 2.0, 0))
    assert unbounded.weights[3] * float(lie.norm()) > 50 * honest[1]  # without the cut: 100× a member's


def test_a_claim_must_start_on_a_block_and_stay_within_the_model():
    claims = claims_in_codes(torch.ones(2), torch.zeros(2, dtype=torch.bool), torch.ones(2), 1.0,
                             torch.ones(2, dtype=torch.float64), 7)
    with pytest.raises(ValueError, match="inside a block"):
        claims.why_not(torch.zeros(4, dtype=torch.int32), 3)
    assert "beyond the model" in claims.why_not(torch.zeros(3 * codec.BLOCK, dtype=torch.int32), 0)


def test_claimed_block_norms_are_never_below_the_truth():
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        x = torch.randn(3 * codec.BLOCK, generator=g) * float(torch.rand(1, generator=g)) * 1e3
        truth = exact.blocked(x.double()).square().sum(dim=1).sqrt()
        assert bool((block_norms(x).double() >= truth).all())


@pytest.mark.parametrize("bits", [NONE, 4])
def test_a_sum_is_held_to_what_its_senders_claimed_by_maxima_and_by_norm(bits):
    """What every member checks of a reducer's sum (sum_why_not): the honest sum passes; a forged one with every
    value at the senders' summed maxima stays within those maxima, and only the norm bound refuses it; one beyond
    the maxima is refused by them."""
    from p2pdiloco.core.claims import sum_why_not

    xs = deltas((1, 1, 1), seed=8)
    _, codes, claims = island_codes([record(f"h{i}", x) for i, x in enumerate(xs)], xs, bits)
    total = sum(c.to(torch.int64) for c in codes)
    for start, end in codec_parts(3):
        assert sum_why_not(total[start:end], start, claims) == ""
    top = sum(c.max_code for c in claims).repeat_interleave(codec.BLOCK)[:N]
    at_the_maxima = top * total.sign()
    assert "norm" in sum_why_not(at_the_maxima, 0, claims)
    assert "maxima" in sum_why_not(at_the_maxima + total.sign(), 0, claims)


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
def test_a_code_beyond_its_claim_in_a_short_last_block_is_caught_whatever_its_sign(sign):
    """The last block of a model is short; its maximum is reduced on its own, and a −7 passes a claimed 2 if its
    sign is not taken off. A reducer's sum of such a block is held the same way."""
    n = 2 * codec.BLOCK + 5
    claims = claims_in_codes(torch.full((3,), 2.0), torch.zeros(3, dtype=torch.bool), torch.full((3,), 1e9), 1.0,
                             torch.ones(3), limit=7)
    codes = torch.zeros(n, dtype=torch.int32)
    codes[-1] = sign * 7
    assert "beyond the block maxima" in claims.why_not(codes, 0)
    codes[-1] = sign * 2
    assert claims.why_not(codes, 0) == ""
    codes[-1] = sign * 5  # two senders that each claimed 2: a sum of 4 at most
    assert "block maxima" in sum_why_not(codes, 0, [claims, claims])
    codes[-1] = sign * 4
    assert sum_why_not(codes, 0, [claims, claims]) == ""


def _claims(maxima, norms, weight=1.0, clipped=None, limit=7):
    maxima, norms = torch.tensor(maxima, dtype=torch.float32), torch.tensor(norms, dtype=torch.float32)
    clipped = torch.zeros(len(maxima), dtype=torch.bool) if clipped is None else torch.tensor(clipped)
    return claims_in_codes(maxima, clipped, norms, weight, torch.ones(len(maxima)), limit)


def test_a_single_code_beyond_its_claim_is_caught_and_the_refusal_counts_and_places_it():
    c = _claims([2.0, 2.0, 2.0], [100.0] * 3)
    assert c.why_not(torch.tensor([], dtype=torch.int32), 0) == ""
    assert c.why_not(torch.tensor([3], dtype=torch.int32), 0).startswith("1 codes beyond")
    codes = torch.zeros(codec.BLOCK + 10, dtype=torch.int32)
    codes[codec.BLOCK + 3], codes[codec.BLOCK + 4], codes[5] = 3, 2, 2  # one beyond; two at the claim
    assert c.why_not(codes, codec.BLOCK) == (f"1 codes beyond the block maxima it claimed (of {codes.numel()}; "
                                             "the first in block 2)")


def test_the_norm_bound_is_the_claimed_norm_of_the_checked_blocks_plus_half_a_code_per_nonzero():
    """Four codes of 1 in block 0 (norm 2) against a claimed norm of 1 there: 1 + 0.5·√4 = 2 allows it, and a
    fifth (norm √5 > 1 + 0.5·√5) is refused; the large norms claimed for other blocks do not count."""
    c = _claims([7.0, 7.0], [1.0, 1000.0])
    codes = torch.zeros(codec.BLOCK, dtype=torch.int32)
    codes[:4] = 1
    assert c.why_not(codes, 0) == ""
    codes[4] = 1
    assert "norm 2.236 is beyond the 2.118" in c.why_not(codes, 0)


def test_claims_take_the_members_weight_and_a_zero_maximum_allows_no_code():
    half = _claims([4.0, 0.0], [100.0, 100.0], weight=0.5)
    assert half.max_code.tolist() == [2, 0] and half.norm.tolist() == [50.0, 50.0]
    codes = torch.zeros(2 * codec.BLOCK, dtype=torch.int32)
    codes[codec.BLOCK] = 1  # in the block it claimed nothing for
    assert half.why_not(codes, 0).startswith("1 codes beyond")


def test_a_sum_is_checked_alone_and_against_every_senders_share_of_rounding():
    c = _claims([2.0], [1.0])
    assert sum_why_not(torch.tensor([9], dtype=torch.int32), 0, []) == ""  # no senders: nothing to hold it to
    assert sum_why_not(torch.tensor([], dtype=torch.int32), 0, [c]) == ""
    assert sum_why_not(torch.tensor([3], dtype=torch.int32), 0, [c]) == \
        "a sum beyond what its senders' claimed block maxima allow"
    total = torch.zeros(16, dtype=torch.int32)  # two senders, each norm 1 + 0.5·√16: a sum of norm 6 at most
    total[:9] = 2  # norm 6
    assert sum_why_not(total, 0, [c, c]) == ""
    total[9] = 1  # norm √37 ≈ 6.08
    assert "a sum of norm 6.083, beyond the 6" in sum_why_not(total, 0, [c, c])
    wide = _claims([2.0, 2.0], [1.0, 1000.0])  # a claimed norm elsewhere does not widen this block's bound
    assert "beyond the" in sum_why_not(total, 0, [wide, wide])


@pytest.mark.parametrize("bits", [NONE, 4])
def test_a_near_zero_update_behind_huge_claimed_maxima_is_still_held_and_counts_for_what_its_claims_back(bits):
    """It claims maxima 50× the island's, so every block of it is clipped and its codes may be clamped, and a
    typical norm, and sends a thousandth of its Δ. Its codes must still carry the share of the norm the clip leaves
    (the backing, about a fifth here): on 20-bit codes they do not, in every part; on int4 that share is within what
    rounding can take, and they pass. Either way the island weighs it by the norm its claims back, not the norm
    it claims: it holds 16 % of the merge's weight, not the 40 % the weight cap alone allows."""
    xs = deltas((1, 1, 1, 1), seed=9)
    claimed = xs[3].clone()
    claimed[:: codec.BLOCK // 4] *= 50.0  # a few values per block: maxima 50×, norms about the same
    honest = [record(f"h{i}", x) for i, x in enumerate(xs[:3])]
    records = honest + [record("evil", xs[3], tokens=4096 * 1000, claimed=claimed)]
    plan, codes, claims = island_codes(records, xs[:3] + [xs[3] * 1e-3], bits, bounds=Bounds.of(OuterConfig()))
    assert bool(plan.clipped[3].all())
    found = problems(codes, claims)
    assert found[:9] == [""] * 9 and all(("short of" in why) == (bits == NONE) for why in found[9:]), found[9:]
    assert plan.weights[3] < 0.2 and "floor" in plan.bounded[3]


def test_an_honest_member_whose_maxima_are_clipped_still_meets_its_floor_at_the_edge():
    """The floor's worst honest case: a block whose values all sit at its maximum, clipped to a tenth, so every
    code is clamped to ±L and keeps exactly the backing's share."""
    x = torch.full((codec.BLOCK,), 3.0)
    x[1::2] *= -1
    claims = claims_in_codes(torch.tensor([0.3]), torch.tensor([True]), block_norms(x), 1.0, torch.tensor([0.3 / 7]),
                             7, backing=torch.tensor([0.1]))
    codes = codec.encode(x, 1.0, torch.tensor([0.3 / 7]).double(), 4, None, with_sent=False).codes
    assert int(codes.abs().max()) == 7 and claims.why_not(codes, 0) == ""
    assert "short of" in claims.why_not(codes // 2, 0)


def test_a_liar_claiming_1000x_its_tokens_moves_the_swarms_clock_by_at_most_twice_a_typical_member():
    """Θ's token count drives every peer's warm-up and lr schedule: counted as claimed, one round of such a liar
    would end the warm-up and most of a cosine schedule for everyone."""
    xs = deltas((1, 1, 1, 1))
    records = [record(f"p{i}", x, tokens=4096 * (1000 if i == 3 else 1)) for i, x in enumerate(xs)]
    island = parse_island(records, Expect(N))
    defaults = Bounds.of(OuterConfig())
    assert plan_island(island, "tokens2", 60.0, N, defaults).tokens == 3 * 4096 + 2 * 4096
    uncapped = dataclasses.replace(defaults, weight_ratio=0.0)
    assert plan_island(island, "tokens2", 60.0, N, uncapped).tokens == 1003 * 4096
    honest = parse_island([record(f"p{i}", x, tokens=t) for i, (x, t) in enumerate(zip(xs, (100, 300, 300, 300)))],
                          Expect(N))
    assert plan_island(honest, "tokens2", 60.0, N, defaults).tokens == 1000  # alike within 2×: all of them
    blamed = [dict(r, blame=["p3"]) if i < 3 else r for i, r in enumerate(records)]
    assert plan_island(parse_island(blamed, Expect(N)), "tokens2", 60.0, N, defaults).tokens == 3 * 4096
