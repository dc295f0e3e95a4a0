"""What one member can do to a merge, whatever it claims: its weight is capped at a multiple of the island's
median, its block maxima are clipped to a multiple of the island's median, and its codes to the agreed range."""

import pytest
import torch

from p2pdiloco.core import codec, exact
from p2pdiloco.core.claims import block_norms
from p2pdiloco.protocol.island import (Bounds, PenaltyBox, Stragglers, cap_to_median, clip_to_block_median, cut_to_median_norm,
                                       discount_stale, member_weights, plan_island)
from p2pdiloco.protocol.island import NO_REDUCER
from p2pdiloco.protocol.remote import Expect, parse_island

N = 4 * codec.BLOCK


def member(peer: str, delta: torch.Tensor, tokens: int = 4096, steps: int = 32, maxabs=None, norms=None,
           version: int = 3) -> dict:
    stat = exact.block_maxabs(delta) if maxabs is None else maxabs
    norms = block_norms(delta) if norms is None else norms
    return dict(peer=peer, name=peer, version=version, digest="abcdef", tokens=tokens, steps=steps, budget=10.0,
                norms=[], maxabs=stat.numpy().tobytes(), block_norms=norms.numpy().tobytes())


def test_a_member_claiming_1000x_the_tokens_gets_at_most_the_capped_share():
    deltas = [torch.randn(N) for _ in range(4)]
    records = [member(f"h{i}", d) for i, d in enumerate(deltas[:3])] + [member("evil", deltas[3], tokens=4096 * 1000)]
    plan = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N)
    honest, evil = plan.weights[:3], plan.weights[3]
    assert sum(plan.weights) == pytest.approx(1.0)
    assert evil == pytest.approx(2 * honest[0]) and honest[0] == honest[1] == honest[2]  # 2/5, not 0.999999
    assert "merge weight capped" in plan.bounded[3] and set(plan.bounded) == {3}
    unbounded = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N, Bounds(0, 0, 0))
    assert unbounded.weights[3] > 0.999  # what one liar decided before


def test_with_stale_factor_half_a_member_a_version_behind_with_two_rounds_in_its_delta_moves_the_merge_one_round():
    """It fell behind because its last round failed while the others merged: its Δ, taken from the version
    before, carries two rounds of steps, and tokens²/steps doubles its weight for them. At full weight (Bounds()'s
    default, no discount) the island steps 1.5 rounds' length (3 members); --stale-factor 0.5 makes it one."""
    direction = torch.randn(N)
    fresh = [member(f"f{i}", direction + 0.01 * torch.randn(N)) for i in range(2)]
    stale = member("stale", 2 * direction, tokens=2 * 4096, steps=2 * 32, version=2)
    island = parse_island([*fresh, stale], Expect(N))

    def length(plan) -> float:  # of the merge Σ wᵢΔᵢ along the common direction, in rounds
        deltas = [direction, direction, 2 * direction]
        merged = sum(w * d for w, d in zip(plan.weights, deltas))
        return float(merged @ direction / (direction @ direction))

    full = plan_island(island, "tokens2", 60.0, N)  # Bounds()'s default: no discount
    assert full.weights[2] == pytest.approx(0.5) and length(full) == pytest.approx(1.5)
    plan = plan_island(island, "tokens2", 60.0, N, Bounds(stale_factor=0.5))  # half the weight per version behind
    assert plan.weights[:2] == full.weights[:2] and plan.weights[2] == pytest.approx(0.25)
    assert length(plan) == pytest.approx(1.0) and sum(plan.weights) == pytest.approx(0.75)
    assert "1 version behind" in plan.bounded[2] and set(plan.bounded) == {2}
    # two versions behind keeps a quarter; members on the newest version are never discounted
    older = plan_island(parse_island([*fresh, {**stale, "version": 1}], Expect(N)), "tokens2", 60.0, N,
                        Bounds(stale_factor=0.5))
    assert older.weights[2] == pytest.approx(0.125) and older.weights[:2] == full.weights[:2]


@pytest.mark.parametrize("weights", [[0.97, 0.01, 0.01, 0.01], [0.5, 0.5], [0.9, 0.1], [0.4, 0.3, 0.2, 0.1],
                                     [0.2, 0.2, 0.2, 0.2, 0.2], [0.6, 0.39, 0.01]])
def test_capped_weights_sum_to_one_and_none_exceeds_the_bound(weights):
    capped, _ = cap_to_median(weights, 2.0)
    assert sum(capped) == pytest.approx(1.0)
    median = sorted(capped)[(len(capped) - 1) // 2]
    assert max(capped) <= 2.0 * median * (1 + 1e-9)
    order = sorted(range(len(weights)), key=weights.__getitem__)
    assert sorted(range(len(capped)), key=capped.__getitem__) == order or len(set(capped)) < len(capped)


def test_between_two_members_the_outlier_is_bounded_by_the_other_not_by_their_mean():
    capped, notes = cap_to_median([0.999, 0.001], 2.0)
    assert capped == pytest.approx([2 / 3, 1 / 3]) and set(notes) == {0}


def test_claimed_block_maxima_are_clipped_to_the_islands_median_per_block():
    honest = [torch.tensor([1.0, 2.0, 0.0]), torch.tensor([1.5, 1.0, 0.0]), torch.tensor([0.5, 3.0, 0.0])]
    hostile = torch.tensor([1e6, 2.0, 5.0])
    clipped, over = clip_to_block_median(honest + [hostile], 4.0)
    # per block, the lower median of the four is 1.0, 2.0 and 0.0: the hostile member is held to 4× that
    assert clipped[3].tolist() == [4.0, 2.0, 0.0] and [o.tolist() for o in over] == [[False] * 3] * 3 + [
        [True, False, True]]
    assert all(torch.equal(a, b) for a, b in zip(clipped[:3], honest))  # honest maxima are untouched


def test_a_member_cannot_wipe_out_the_others_precision_with_huge_maxima():
    torch.manual_seed(0)
    deltas = [torch.randn(N) * 1e-3 for _ in range(3)]
    huge = exact.block_maxabs(torch.full((N,), 1e3))  # claims maxima a million times the others'
    clean = [member(f"h{i}", d) for i, d in enumerate(deltas)]

    def honest_error(records, bounds):
        plan = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N, bounds)
        scales = codec.agreed_scales([m.double() * w for m, w in zip(plan.maxabs, plan.weights)], 4)
        sent = codec.encode(deltas[0], plan.weights[0], scales, 4).sent
        return float((sent - deltas[0]).norm() / deltas[0].norm())

    attacked = clean + [member("evil", torch.zeros(N), maxabs=huge)]
    assert honest_error(attacked, Bounds(0, 0, 0)) == pytest.approx(1.0)  # unclipped: every honest value rounds to 0
    bounds = Bounds()
    # clipped: the scales can be at most scale_ratio× coarser than the honest ones, and so can the error
    assert honest_error(attacked, bounds) <= 1.1 * bounds.scale_ratio * honest_error(clean, bounds)


def test_a_scaled_lying_member_moves_the_merge_by_at_most_its_capped_share_of_the_clipped_range():
    """Three honest members and one that sends ×100 its Δ while claiming 1000× its tokens and honest maxima: in
    the int4 sum (every sender's codes within ±L, as reducers enforce) it moves each value by at most its capped
    weight times its clipped block maximum."""
    torch.manual_seed(1)
    deltas = [torch.randn(N) for _ in range(4)]
    records = [member(f"h{i}", d) for i, d in enumerate(deltas[:3])] + [
        member("evil", deltas[3], tokens=4096 * 1000)]
    plan = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N)
    scales = codec.agreed_scales([m.double() * w for m, w in zip(plan.maxabs, plan.weights)], 4)
    sent = [deltas[0], deltas[1], deltas[2], deltas[3] * 100]  # the liar scales what it actually sends
    encoded = [codec.encode(d, w, scales, 4) for d, w in zip(sent, plan.weights)]
    merged = codec.dequantize(sum(e.codes for e in encoded), scales)
    honest = sum(d * w for d, w in zip(deltas[:3], plan.weights[:3]))
    per_element = lambda blocks: blocks.repeat_interleave(codec.BLOCK)[:N]  # noqa: E731
    liar_bound = per_element(plan.maxabs[3].double() * plan.weights[3])
    rounding = per_element(scales) * 3 / 2  # the honest members' own quantization error
    assert bool(((merged - honest).abs() <= liar_bound + rounding + 1e-6).all())
    assert plan.weights[3] == pytest.approx(0.4)
    unbounded = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N, Bounds(0, 0, 0))
    assert unbounded.weights[3] > 0.999  # before: its weight made its ×100 Δ the merge


def test_exact_quantize_clamps_to_the_agreed_range():
    scales = torch.ones(1, dtype=torch.float64)
    q = exact.quantize(torch.tensor([5.0, -9.0, 2.0]), 1.0, scales, limit=4)
    assert q.tolist() == [4.0, -4.0, 2.0]


def test_a_member_blamed_by_most_others_is_left_out_and_a_blaming_minority_cannot_leave_out_anyone():
    delta = torch.randn(N)
    honest = [member(f"h{i}", delta) for i in range(3)]
    evil = member("evil", delta)
    blaming = [dict(r, blame=["evil"]) for r in honest]
    plan = plan_island(parse_island([*blaming[:2], honest[2], evil], Expect(N)), "tokens2", 60.0, N)
    assert plan.weights[3] == 0.0 and plan.included == [0, 1, 2]  # 2 of its 3 others blame it
    minority = plan_island(parse_island([blaming[0], honest[1], honest[2], evil], Expect(N)), "tokens2", 60.0, N)
    assert minority.included == [0, 1, 2, 3]  # one of three is not a majority
    liar = dict(evil, blame=["h0", "h1", "h2"])  # the hostile member blames every honest one
    assert plan_island(parse_island([*honest, liar], Expect(N)), "tokens2", 60.0, N).included == [0, 1, 2, 3]


def test_client_mode_members_are_merged_but_reduce_no_part_and_an_island_of_clients_merges_nothing():
    records = [member(f"p{i}", torch.randn(N)) for i in range(4)]
    plan = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N, clients=frozenset({1, 3}))
    assert plan.included == [0, 1, 2, 3] and plan.reducers == [0, 2]
    blamed = [dict(r, blame=["p0"]) for r in records[1:]]  # the only other dialable member is left out
    plan = plan_island(parse_island([records[0], *blamed], Expect(N)), "tokens2", 60.0, N, clients=frozenset({1, 3}))
    assert plan.included == [1, 2, 3] and plan.reducers == [2]
    alone = plan_island(parse_island([records[0], *blamed[:1], blamed[2]], Expect(N)), "tokens2", 60.0, N,
                        clients=frozenset({1, 2}))
    assert alone.weights is None and "client mode" in alone.reason


def test_client_mode_is_checked_at_configuration():
    from p2pdiloco.config import ConfigError, SwarmConfig

    with pytest.raises(ConfigError, match="needs --initial-peers"):
        SwarmConfig(client_mode=True)
    assert SwarmConfig(client_mode=True, initial_peers=("/ip4/10.0.0.1/tcp/1/p2p/x",)).client_mode


@pytest.mark.parametrize("blame, ok", [(["a"], True), ([], True), (["a"] * 65, False), ("a", False), ([3], False),
                                       ([""], False), (["x" * 500], False)])
def test_the_blame_list_is_validated_like_every_remote_field(blame, ok):
    island = parse_island([dict(member("p", torch.ones(N)), blame=blame)], Expect(N))
    assert (island.members[0] is not None) == ok


def test_blame_expires():
    from p2pdiloco.protocol.island import PenaltyBox

    box = PenaltyBox(seconds=10.0)
    box.blame({"x", "y"}, now=100.0)
    box.blame({"y"}, now=105.0)
    assert box.active(109.0) == ["y", "x"] and box.active(112.0) == ["y"] and box.active(200.0) == []


def test_the_bounds_and_the_robust_merge_are_checked_at_configuration():
    from p2pdiloco.config import ConfigError, OuterConfig, SwarmConfig

    assert SwarmConfig().robust_merge and not SwarmConfig(robust_merge=False).robust_merge  # on by default
    for bad in (0.5, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="max weight ratio"):
            OuterConfig(max_weight_ratio=bad)
    with pytest.raises(ConfigError, match="max norm ratio"):
        OuterConfig(max_norm_ratio=0.9)
    assert OuterConfig(max_weight_ratio=0, max_scale_ratio=0, max_norm_ratio=0).max_norm_ratio == 0


def test_a_faster_honest_member_adds_more_to_the_merge_but_at_most_the_bounds_product():
    """A GPU peer and a CPU peer contribute every 2 s: the GPU's Δ comes from 4× the steps and tokens, and is
    longer. In an island of two the slower member is the median, so the bounds cap the faster one's weight and
    cut it for its norm; what it adds, w·|Δ|, still exceeds the slower one's, and by at most 2 × 2 (measured on an
    H100: 2.75-4.0× for 1.8-5.9× the tokens)."""
    torch.manual_seed(0)
    slow, fast = 0.1 * torch.randn(N), 0.5 * torch.randn(N)
    records = [member("cpu", slow, tokens=32_768, steps=64), member("gpu", fast, tokens=131_072, steps=256)]
    island = parse_island(records, Expect(N))
    assert [m.delta_norm for m in island.members] == pytest.approx([float(slow.norm()), float(fast.norm())], rel=1e-6)
    plan = plan_island(island, "tokens2", 60.0, N)
    adds = [w * m.delta_norm for w, m in zip(plan.weights, island.members)]
    assert adds[0] < adds[1] <= 4 * adds[0] * (1 + 1e-9)
    assert "merge weight capped" in plan.bounded[1] and "weight cut" in plan.bounded[1]


def test_a_member_blamed_by_one_other_is_merged_but_reduces_no_part():
    """A failed reducer costs the whole island its round: the peer a member blames must not get a part to fail again
    in the next island they share, even where nobody else blames it yet (and whoever leads the island)."""
    delta = torch.randn(N)
    honest = [member(f"h{i}", delta) for i in range(3)]
    evil = member("evil", delta)
    plan = plan_island(parse_island([dict(honest[0], blame=["evil"]), honest[1], honest[2], evil], Expect(N)),
                       "tokens2", 60.0, N)
    assert plan.included == [0, 1, 2, 3] and plan.reducers == [0, 1, 2] and list(plan.relieved) == [3]
    assert "h0" in plan.relieved[3]
    three = plan_island(parse_island([dict(honest[0], blame=["evil"]), honest[1], evil], Expect(N)), "tokens2", 60.0, N)
    assert three.included == [0, 1, 2] and three.reducers == [0, 1]  # 1 of its 2 others: merged, not reducing


def test_a_liar_blaming_everyone_relieves_nobody_and_never_all_dialable_members_are_relieved():
    delta = torch.randn(N)
    honest = [member(f"h{i}", delta) for i in range(3)]
    liar = dict(member("evil", delta), blame=["h0", "h1", "h2"])  # to take every part to itself
    assert plan_island(parse_island([*honest, liar], Expect(N)), "tokens2", 60.0, N).reducers == [0, 1, 2, 3]
    two = dict(member("evil", delta), blame=["h0", "h1"])  # 2 of its 3 others: more than half
    assert plan_island(parse_island([*honest, two], Expect(N)), "tokens2", 60.0, N).relieved == {}
    one = dict(member("evil", delta), blame=["h0"])  # as credible as anyone's: h0 is relieved, merged still
    plan = plan_island(parse_island([*honest, one], Expect(N)), "tokens2", 60.0, N)
    assert plan.included == [0, 1, 2, 3] and plan.reducers == [1, 2, 3]
    # a pair blaming each other in an island of three: each list names 1 of 2 others; the third reduces alone
    pair = [dict(honest[0], blame=["h1"]), dict(honest[1], blame=["h0"]), honest[2]]
    assert plan_island(parse_island(pair, Expect(N)), "tokens2", 60.0, N).reducers == [2]
    # a member left out (blamed by most) blames no one any more
    left = dict(member("evil", delta), blame=["h0"])
    plan = plan_island(parse_island([*[dict(h, blame=["evil"]) for h in honest], left], Expect(N)), "tokens2", 60.0, N)
    assert plan.included == [0, 1, 2] and plan.reducers == [0, 1, 2] and plan.relieved == {}
    # every dialable member relieved: then none is (someone has to reduce), the clients still reduce nothing
    mutual = [dict(honest[0], blame=["h1"]), dict(honest[1], blame=["h0"]), honest[2]]
    plan = plan_island(parse_island(mutual, Expect(N)), "tokens2", 60.0, N, clients=frozenset({2}))
    assert plan.included == [0, 1, 2] and plan.reducers == [0, 1]


def test_a_norm_cut_bounds_the_long_member_and_gives_its_share_to_nobody():
    """Norms [1, 1, 10] with the bound at 2× the median: the outlier keeps 0.2 of its weight, so it adds twice a
    typical member's Δ, and the others keep their 1/3 each: the merge is the mean of the members' Δs, the long one
    clipped to the bound. Renormalised (5/11, 5/11, 1/11, as until 2026-11-29), the others' share grew with every
    member cut, and a pair of ×100 liars made each merge 3/2 of a clean one (docs/hostile.md)."""
    weights, notes = cut_to_median_norm([1 / 3] * 3, [1.0, 1.0, 10.0], 2.0)
    assert weights == pytest.approx([1 / 3, 1 / 3, 1 / 15], rel=1e-12)
    assert set(notes) == {2} and "0.2×" in notes[2]
    merged, bounded = member_weights([4096] * 3, [32] * 3, [1.0, 1.0, 10.0], [3, 3, 3], "tokens2",
                                     Bounds(influence_ratio=0))
    assert merged == pytest.approx([1 / 3, 1 / 3, 1 / 15]) and [k for k, _ in bounded] == [2]
    # one that also claimed 1000× its tokens (its weight capped at 2× the median): its claimed weight beyond a
    # typical member's goes to nobody either, so the others keep 1/3 (with no influence bound it adds 2 × 2)
    merged, _ = member_weights([4096, 4096, 4096 * 1000], [32] * 3, [1.0, 1.0, 10.0], [3, 3, 3], "tokens2",
                               Bounds(influence_ratio=0))
    assert merged[:2] == pytest.approx([1 / 3, 1 / 3]) and merged[2] * 10.0 == pytest.approx(2 * merged[0] * 2)


def test_an_island_with_nothing_to_merge_keeps_its_deadline_and_who_was_left_out():
    delta = torch.randn(N)
    blaming = [dict(member(f"h{i}", delta), blame=["evil"], budget=20.0) for i in range(2)]
    evil = member("evil", delta)
    no_tokens = plan_island(parse_island([dict(r, tokens=0, steps=0) for r in blaming] + [evil], Expect(N)),
                            "tokens2", 60.0, N)
    assert no_tokens.weights is None and "no tokens" in no_tokens.reason
    assert no_tokens.deadline == 20.0 and set(no_tokens.left_out) == {2}
    assert "blamed by 2 of the 2" in no_tokens.left_out[2]
    both = plan_island(parse_island([None, dict(evil, blame=["h0"]), dict(member("h0", delta), blame=["evil"])],
                                    Expect(N)), "tokens2", 60.0, N)  # two that blame each other: a majority each
    assert both.weights is None and set(both.left_out) == {1, 2} and both.deadline == 10.0
    assert both.reason == "no member's record was well-formed, or every member was blamed"
    gone = plan_island(parse_island([None, 7], Expect(N)), "tokens2", 60.0, N)
    assert gone.weights is None and gone.reason == "no member's record was well-formed, or every member was blamed"
    assert gone.deadline == 60.0 and gone.left_out == {}


def test_a_member_bounded_twice_has_both_notes_and_a_left_out_member_is_named():
    """Capped weight (1000× the tokens) and clipped maxima (1000× the values): one note each, joined."""
    delta = torch.randn(N)
    records = [member(f"h{i}", delta) for i in range(3)]
    big = member("big", delta, tokens=4096 * 1000, maxabs=exact.block_maxabs(delta) * 1000)
    blamed = dict(member("blamed", delta), blame=[])
    records = [dict(r, blame=["blamed"]) for r in records]
    plan = plan_island(parse_island([*records, big, blamed], Expect(N)), "tokens2", 60.0, N)
    assert plan.bounded[3] == "merge weight capped at 2× the island's median; 4 block maxima clipped"
    assert set(plan.left_out) == {4} and plan.weights[4] == 0.0 and plan.maxabs[4].sum() == 0
    assert plan.norms[4].sum() == 0 and not plan.clipped[4].any() and plan.clipped[4].dtype == torch.bool


def test_members_with_a_zero_delta_do_not_count_in_the_median_norm():
    """Two members that trained nothing (norm 0) and one that did: no median of positive norms to cut it by.
    Counted as norm 1 (or 0), the third would be cut to a sliver of its weight."""
    zero, moved = torch.zeros(N), torch.randn(N) * 5
    plan = plan_island(parse_island([member("z0", zero), member("z1", zero), member("m", moved)], Expect(N)),
                       "tokens2", 60.0, N)
    assert plan.weights == pytest.approx([1 / 3] * 3) and not any("cut" in why for why in plan.bounded.values())


def test_a_floored_members_loss_goes_to_the_others_a_long_members_to_nobody_in_one_island():
    """Five members of equal tokens: three typical, one whose Δ is 10× theirs (cut to 2×), one near zero (floored).
    The near-zero member's weight goes to the others, the long member's to nobody: each typical member weighs what
    it would beside one typical fourth member, 1/4 (bar the near-zero member's kept 0.0004 of 0.8), and the long one
    adds twice a typical member's Δ."""
    merged, bounded = member_weights([4096] * 5, [32] * 5, [1.0, 1.0, 1.0, 10.0, 1e-3], [3] * 5, "tokens2",
                                     Bounds(norm_ratio=2.0, floor_ratio=2.0, influence_ratio=0))
    assert merged[:3] == pytest.approx([0.2 / 0.8004] * 3) and merged[3] * 10.0 == pytest.approx(2 * merged[0])
    assert sorted(k for k, _ in bounded) == [3, 4]


@pytest.mark.parametrize("norms, ratio, cut", [
    ([0.0, 0.0], 2.0, None),  # nothing trained: nothing to cut by
    ([1e-3, 1e-3, 1e-2], 2.0, [1 / 3, 1 / 3, 1 / 15]),  # small norms: the same rule
    ([1.0, 1.0, 2.0], 1.0, [1 / 3, 1 / 3, 1 / 6]),  # a ratio of 1 cuts anything above the median
    ([0.0, 1.0, 1.0, 4.0], 2.0, [1 / 4, 1 / 4, 1 / 4, 1 / 8]),  # a zero norm is no member of the median
])
def test_a_norm_cut_by_the_rule_at_its_edges(norms, ratio, cut):
    weights = [1 / len(norms)] * len(norms)
    got, notes = cut_to_median_norm(weights, norms, ratio)
    assert got == pytest.approx(cut or weights, rel=1e-12)
    assert set(notes) == ({len(norms) - 1} if cut else set())


def test_a_norm_cut_says_by_how_much_and_why():
    _, notes = cut_to_median_norm([1 / 3] * 3, [1.0, 1.0, 10.0], 2.0)
    assert notes == {2: "weight cut to 0.2× (its Δ's norm is 5× the bound of 2× the island's median)"}


def test_stale_discounts_say_how_far_behind_and_none_at_factor_one():
    weights = [0.5, 0.25, 0.25]
    same, notes = discount_stale(weights, [5, 4, 3], 1.0)
    assert same == weights and notes == {}
    discounted, notes = discount_stale(weights, [5, 4, 3], 0.5)
    assert discounted == [0.5, 0.125, 0.0625]
    assert notes == {1: "weight × 0.5: 1 version behind", 2: "weight × 0.25: 2 versions behind"}
    assert discount_stale(weights, [5, 5, 5], 0.5) == (weights, {})


def test_blame_notes_name_the_count_or_the_blamers():
    from p2pdiloco.protocol.island import blamed_by_a_few, blamed_by_majority

    delta = torch.randn(N)
    records = [dict(member(f"h{i}", delta), blame=["evil"]) for i in range(2)] + [member("h2", delta),
                                                                                   member("evil", delta)]
    island = parse_island(records, Expect(N))
    assert blamed_by_majority(island) == {3: "blamed by 2 of the 3 others for a failed round"}
    nameless = dict(member("12D3KooWabcdefghij", delta), name="", blame=["h2"])
    few = blamed_by_a_few(parse_island([nameless, member("h2", delta), member("h3", delta)], Expect(N)))
    assert few == {1: "blamed by efghij: reduces no part"}  # no name: the last six characters of its id
    two = parse_island([dict(member("a", delta), blame=["c"]), dict(member("b", delta), blame=["c"]),
                        member("c", delta), member("d", delta), member("e", delta)], Expect(N))
    assert blamed_by_a_few(two) == {2: "blamed by a, b: reduces no part"}


def test_the_lower_median_is_the_middle_or_the_lower_of_the_two_middles():
    from p2pdiloco.protocol.island import lower_median

    assert lower_median([3.0]) == 3.0 and lower_median([5.0, 1.0]) == 1.0 and lower_median([9.0, 1.0, 5.0]) == 5.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0 and lower_median([6.0, 1.0, 5.0, 2.0, 4.0, 3.0, 7.0]) == 4.0


def test_the_weight_cap_at_its_edges():
    assert cap_to_median([0.9, 0.1], 0.0) == ([0.9, 0.1], {})  # 0: no bound
    assert cap_to_median([1.0], 2.0) == ([1.0], {})  # alone: nothing to compare with
    capped, notes = cap_to_median([0.6, 0.2, 0.2], 1.0)  # a ratio of 1: none above the median
    assert capped == pytest.approx([1 / 3] * 3) and set(notes) == {0}
    exact_bound, notes = cap_to_median([0.5, 0.25, 0.25], 2.0)  # at the bound exactly: not capped
    assert exact_bound == [0.5, 0.25, 0.25] and notes == {}
    zeros, notes = cap_to_median([1.0, 0.0, 0.0], 2.0)  # zeros are no members of the median
    assert zeros == [1.0, 0.0, 0.0] and notes == {}
    assert cap_to_median([1.0], 0.5) == ([1.0], {})  # alone, whatever the ratio
    assert cap_to_median([0.2, 0.2], 3.0) == ([0.2, 0.2], {})  # none over the bound: the weights as given


def test_the_token_count_a_merge_adds_is_each_members_at_most_ratio_times_the_lower_median():
    """What the schedule runs by: a liar's 1000× claim counts as ratio × the island's lower median of positive
    claims; zeros are no members of that median; a member not merged adds nothing."""
    from p2pdiloco.protocol.island import counted_tokens

    assert counted_tokens([10, 20], [True, True], 1.0) == 20  # a ratio of 1: the lower median, 10, each
    assert counted_tokens([10, 20], [True, True], 0.0) == 30  # 0: no cap
    assert counted_tokens([0, 0, 10, 20], [True] * 4, 2.0) == 30  # the median of 10 and 20, not of the zeros
    assert counted_tokens([1, 1, 1, 100], [True] * 4, 2.0) == 5  # the liar counts as 2
    assert counted_tokens([10, 10, 10_000], [True, False, True], 2.0) == 30


def test_the_dilution_cut_at_its_edges():
    """A member's weight × min(1, its norm × ratio / the upper median of the positive norms)."""
    from p2pdiloco.protocol.island import cut_below_median_norm

    weights = [0.25] * 4
    cut, notes = cut_below_median_norm(weights, [1.0, 2.0, 4.0, 8.0], 1.0)  # upper median 4 (index 4 // 2)
    assert cut == [0.0625, 0.125, 0.25, 0.25] and set(notes) == {0, 1}
    assert cut_below_median_norm([0.5, 0.5], [1.0, 4.0], 1.0)[0] == [0.125, 0.5]  # two norms are enough
    assert cut_below_median_norm([0.5, 0.5], [1.0, 4.0], 2.0)[0] == [0.25, 0.5]  # a ratio of 2 halves the floor
    # zeros are no members of the median: the floor is 2's, and the zero-norm members count for nothing
    cut, notes = cut_below_median_norm([0.2] * 5, [0.0, 0.0, 0.0, 2.0, 2.0], 1.0)
    assert cut == [0.0, 0.0, 0.0, 0.2, 0.2] and set(notes) == {0, 1, 2}
    assert cut_below_median_norm(weights, [1.0, 2.0, 4.0, 8.0], 0.0) == (weights, {})  # 0: no floor
    assert cut_below_median_norm([1.0], [1.0], 1.0) == ([1.0], {})  # alone: nothing to compare with
    assert cut_below_median_norm([0.5, 0.5], [1.0, 1.0], 0.5)[0] == [0.25, 0.25]  # below 1 the floor is above all


def test_block_maxima_clipping_at_its_edges():
    stats = [torch.tensor([1.0, 10.0]), torch.tensor([1.0, 1.0])]
    assert clip_to_block_median(stats, 0.0)[0] is stats  # 0: no bound
    one = clip_to_block_median(stats[:1], 2.0)
    assert one[0] is stats[:1] or one[0] == stats[:1]
    assert one[1][0].dtype == torch.bool and not one[1][0].any()
    clipped, over = clip_to_block_median(stats, 2.0)  # two members: the lower one is the median
    assert clipped[0].tolist() == [1.0, 2.0] and over[0].tolist() == [False, True] and not over[1].any()
    three = [torch.tensor([1.0]), torch.tensor([4.0]), torch.tensor([100.0])]
    clipped, over = clip_to_block_median(three, 1.5)  # median 4: bound 6
    assert [c.item() for c in clipped] == [1.0, 4.0, 6.0] and [o.item() for o in over] == [False, False, True]
    assert clip_to_block_median(three, 1.0)[0][2].item() == 4.0


def test_an_island_of_clients_keeps_its_deadline_and_who_was_left_out():
    delta = torch.randn(N)
    records = [dict(member("a", delta), budget=20.0), member("b", delta)]
    plan = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N, clients=frozenset({0, 1}))
    assert plan.weights is None and plan.deadline == 20.0 and plan.clients == {0, 1} and plan.left_out == {}
    assert plan.reason == NO_REDUCER
    blamed = [dict(member("a", delta), blame=["c"]), dict(member("b", delta), blame=["c"]), member("c", delta)]
    plan = plan_island(parse_island(blamed, Expect(N)), "tokens2", 60.0, N, clients=frozenset({0, 1}))
    assert plan.weights is None and set(plan.left_out) == {2}  # the one dialable member was left out


def test_deadlines_and_budgets_at_their_edges():
    from p2pdiloco.protocol.timing import RoundClock, agreed_deadline

    assert agreed_deadline([0.5, 0.2], 60.0) == 0.5  # budgets below a second are honest too
    assert agreed_deadline([0.0, -1.0], 60.0) == 60.0 and agreed_deadline([], 60.0) == 60.0
    clock = RoundClock()
    assert clock.allreduce_budget(100.0, 0.5) == 3.0 + 3.0 * 100.0  # a rate below 1 byte/s counts as 1
    clock.throughput.update(1.5)
    assert clock.allreduce_budget(150.0, 1e6) == pytest.approx(3.0 + 3.0 * 100.0)


def test_blame_and_refusals_end_at_their_time_and_the_oldest_refusal_goes_first():
    from p2pdiloco.core.reach import RefusedKeys

    box = PenaltyBox(seconds=10.0)
    box.blame(["z", "a"], now=0.0)
    box.blame(["m"], now=1.0)
    assert box.active(0.5) == ["m", "z", "a"] and box.active(10.0) == ["m"]  # ended at 10.0: not active then
    keys = RefusedKeys(seconds=10.0, limit=2)
    keys.refuse((9, "a"), now=0.0)
    keys.refuse((1, "b"), now=1.0)
    keys.refuse((5, "c"), now=2.0)  # over the limit: the one refused first goes, not the lowest key
    assert keys.active(3.0) == {(1, "b"), (5, "c")} and keys.active(11.0) == {(5, "c")}
    late = Stragglers(window=10.0)
    late.late(["a"], now=0.0)
    assert late.late(["a"], now=10.0) == frozenset()  # exactly a window later: outside it


def test_top_k_keeps_one_value_of_a_block_too_small_for_its_fraction():
    assert codec.TopKFormat(4, 1, 0.01).k(50) == 1 and codec.TopKFormat(4, 1, 0.5).k(1) == 1


def test_the_influence_bound_caps_weight_times_norm_where_the_two_caps_alone_allow_their_product():
    """A liar whose claims match its lie: ×4 its Δ (its block norms claimed as they are) and 1000× its tokens.
    The weight cap (2×) and the norm cut (2×) each hold, and it still adds 4× a typical member's vector; with
    --max-influence-ratio 1.5 it adds 1.5×, the honest members keep their ratios to one another, and the weight it
    lost goes to nobody: each honest member weighs what it would in a clean island of four (1/4), not 1/3."""
    torch.manual_seed(0)
    deltas = [torch.randn(N) for _ in range(3)] + [4 * torch.randn(N)]
    records = [member(f"h{i}", d) for i, d in enumerate(deltas[:3])] + [member("evil", deltas[3], tokens=4096 * 1000)]
    norms = [float(d.norm()) for d in deltas]

    def added(bounds):  # what each member adds to the merge: its weight times its Δ's norm
        weights = plan_island(parse_island(records, Expect(N)), "tokens2", 60.0, N, bounds).weights
        return [w * n for w, n in zip(weights, norms)], weights

    two_caps, _ = added(Bounds())
    assert two_caps[3] / sorted(two_caps)[1] == pytest.approx(4.0, rel=0.05)  # 2 × 2, as the caps compose
    bounded, weights = added(Bounds(influence_ratio=1.5))
    assert bounded[3] / sorted(bounded)[1] == pytest.approx(1.5, rel=1e-6)
    assert weights[:3] == pytest.approx([0.25] * 3)


@pytest.mark.parametrize("seed", range(20))
def test_no_member_adds_more_than_the_influence_ratio_times_the_median(seed):
    from p2pdiloco.protocol.island import cap_influence, lower_median
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(2, 9, (1,), generator=g))
    weights = torch.rand(k, generator=g).tolist()
    norms = (torch.rand(k, generator=g) * torch.tensor([1.0, 100.0])[torch.randint(0, 2, (k,), generator=g)]).tolist()
    total = sum(weights)
    weights = [w / total for w in weights]
    capped, notes = cap_influence(weights, norms, 1.5)
    products = [w * n for w, n in zip(capped, norms)]
    assert max(products) <= 1.5 * lower_median(products) * (1 + 1e-9)
    before = [w * n for w, n in zip(weights, norms)]
    assert set(notes) == {i for i, x in enumerate(before) if x > 1.5 * lower_median(before) * (1 + 1e-12)}
    assert all(capped[i] == weights[i] for i in range(k) if i not in notes)  # the others are left as they were
    assert cap_influence(weights, norms, 0.0) == (weights, {})  # 0: no bound
