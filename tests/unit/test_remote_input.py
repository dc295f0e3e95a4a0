"""The one parser of remote input: malformed or hostile member records are excluded with a reason, never raise,
and cannot steer the merge (weights, deadline, group scales)."""

import math
import os
import random

import pytest
import torch

from p2pdiloco.core import exact
from p2pdiloco.core.claims import block_norms
from p2pdiloco.protocol.island import Bounds, plan_island
from p2pdiloco.protocol.remote import Expect, Malformed, parse_island, parse_member, parse_peer_record

N = 3 * exact.BLOCK + 5
EXPECT = Expect(N)


def good(**change) -> dict:
    record = dict(peer="12D3KooWpeer", name="a", version=4, digest="abcdef0123", tokens=2048, steps=16,
                  budget=12.0, norms=[], maxabs=exact.block_maxabs(torch.ones(N)).numpy().tobytes(),
                  block_norms=block_norms(torch.ones(N)).numpy().tobytes())
    return {**record, **change}


@pytest.mark.parametrize("change, why", [
    (dict(tokens=-1), "tokens"), (dict(tokens=1.5), "tokens"), (dict(tokens=True), "tokens"),
    (dict(tokens=2 ** 60), "tokens"), (dict(steps=0), "tokens without steps"), (dict(version="4"), "version"),
    (dict(digest="ab"), "digest"), (dict(peer=""), "peer"), (dict(name="x" * 500), "name"),
    (dict(norms=[1.0]), "norms"), (dict(maxabs=b"\0" * 8), "maxabs"),
    (dict(maxabs=torch.full((3 + 1,), math.nan).numpy().tobytes()), "non-finite"),
    (dict(maxabs=torch.full((4,), -1.0).numpy().tobytes()), "negative"),
    (dict(block_norms=b"\0" * 8), "block_norms"), (dict(block_norms=None), "block_norms"),
    (dict(block_norms=torch.full((4,), math.inf).numpy().tobytes()), "non-finite"),
    (dict(block_norms=torch.full((4,), -1.0).numpy().tobytes()), "negative"),
    (dict(extra=1), "unknown fields"),
])
def test_each_malformed_field_is_rejected_with_its_reason(change, why):
    with pytest.raises(Malformed, match=why):
        parse_member(good(**change), EXPECT)


def test_missing_fields_and_non_records_are_rejected():
    record = good()
    del record["steps"]
    for value in (record, None, [1, 2], "x", 7):
        with pytest.raises(Malformed):
            parse_member(value, EXPECT)


def test_rda_norms_must_match_the_swarms_segments_and_be_finite():
    assert parse_member(good(norms=[1.0, 2.0]), Expect(N, 2)).norms == (1.0, 2.0)
    for norms in ([1.0], [1.0, math.inf], [1.0, -2.0], ["a", 1.0]):
        with pytest.raises(Malformed):
            parse_member(good(norms=norms), Expect(N, 2))


def test_a_hostile_budget_cannot_hang_or_cut_short_the_round():
    assert parse_member(good(budget=math.nan), EXPECT).budget == math.inf
    island = parse_island([good(budget=5.0), good(peer="b", budget=-3)], EXPECT)
    assert plan_island(island, "tokens2", 60.0, N).deadline == 60.0
    assert plan_island(parse_island([good(budget=5.0), good(peer="b", budget=7.0)], EXPECT), "tokens2", 60.0, N).deadline == 7.0


def test_malformed_members_are_excluded_from_the_merge_and_the_others_still_merge():
    island = parse_island([good(), good(peer="b", tokens=math.nan), None, good(peer="c", tokens=1024, steps=16)],
                          EXPECT)
    assert [m is None for m in island.members] == [False, True, True, False]
    assert island.excluded_by_index().keys() == {"1", "2"}
    plan = plan_island(island, "tokens2", 60.0, N, Bounds(weight_ratio=0, scale_ratio=0))
    assert plan.weights[1] == plan.weights[2] == 0.0
    assert sum(plan.weights) == pytest.approx(1.0) and plan.weights[0] == pytest.approx(0.8)


def test_an_island_with_nothing_to_merge_says_why():
    assert plan_island(parse_island([None, 3], EXPECT), "tokens2", 60.0, N).weights is None
    plan = plan_island(parse_island([good(tokens=0, steps=0)], EXPECT), "tokens2", 60.0, N)
    assert plan.weights is None and "no tokens" in plan.reason


def test_fuzzed_member_and_peer_records_never_raise_out_of_the_parser():
    """A bounded fuzz run: random field mutations of well-formed records (types, sizes, specials)."""
    rng = random.Random(0)
    specials = [None, -1, 0, 2 ** 70, math.nan, math.inf, "", "x" * 10_000, b"\xff" * 7, [], {}, [math.nan],
                True, 1.5, object()]
    base_peer = dict(peer="p", name="n", version=1, digest="abcdef", ready=-1, inner_step=0, tokens_per_s=1.0,
                     sketch=[0.0] * 4, wire=1)
    for _ in range(int(os.environ.get("P2PDILOCO_FUZZ_ROUNDS", 3000))):  # scripts/bench/mutation.sh runs fewer
        member, peer = good(), dict(base_peer)
        for record in (member, peer):
            for _ in range(rng.randint(1, 3)):
                key = rng.choice(list(record) + ["junk"])
                record[key] = rng.choice(specials)
        island = parse_island([member, good()], EXPECT)  # never raises
        assert island.members[1] is not None
        plan_island(island, rng.choice(["tokens2", "tokens", "uniform"]), 60.0, N)
        parsed = parse_peer_record(peer)
        assert parsed is None or isinstance(parsed.version, int)


def test_the_averager_turns_an_undecodable_gathered_record_into_an_excluded_member():
    """hivemind wraps each member's record as (bandwidth, mode, user); garbage at either level is excluded."""
    from types import SimpleNamespace

    from hivemind.utils.serializer import MSGPackSerializer

    from p2pdiloco.swarm.averager import ExactAverager

    host = SimpleNamespace(serializer=MSGPackSerializer)
    record = good()
    wrapped = MSGPackSerializer.dumps((1.0, 0, MSGPackSerializer.dumps(record)))
    assert ExactAverager._user_record(host, wrapped) == record
    for garbage in (b"\xff\x00garbage", MSGPackSerializer.dumps((1.0, 0, b"\xc1")), MSGPackSerializer.dumps(7)):
        island = parse_island([ExactAverager._user_record(host, garbage), record], EXPECT)
        assert island.members[0] is None and island.members[1] is not None


@pytest.mark.parametrize("field", ["maxabs", "block_norms"])
@pytest.mark.parametrize("blocks", [3, 5, 400], ids=["one-short", "one-over", "many-over"])
def test_a_block_statistic_of_another_length_is_excluded_and_the_island_still_plans(field, blocks):
    """N spans 4 blocks. A statistic a block longer (or shorter) is refused at the parser: accepted, it made
    `plan_island` raise, and one stranger could fail every island it joined."""
    with pytest.raises(Malformed, match=field):
        parse_member(good(**{field: torch.ones(blocks).numpy().tobytes()}), EXPECT)
    odd = good(peer="12D3KooWb", **{field: torch.ones(blocks).numpy().tobytes()})
    island = parse_island([good(peer="12D3KooWa"), odd, good(peer="12D3KooWc")], EXPECT)
    assert island.members[1] is None and field in island.rejected[1]
    plan = plan_island(island, "tokens2", 60.0, N)
    assert plan.weights[1] == 0.0 and plan.weights[0] == plan.weights[2] == pytest.approx(0.5)


def test_a_refused_value_is_quoted_whole_up_to_40_characters_and_cut_beyond():
    for value, said in ((7.5, "7.5"), ("x" * 38, repr("x" * 38)), ("x" * 39, repr("x" * 37)[:37] + "...")):
        with pytest.raises(Malformed) as e:
            parse_member(good(tokens=value), EXPECT)
        assert str(e.value) == f"tokens must be an integer in [0, {2 ** 53}], got {said}"


@pytest.mark.parametrize("change, message", [
    (dict(tokens=-1), "tokens must be an integer in [0, 9007199254740992], got -1"),
    (dict(steps="1"), "steps must be an integer in [0, 9007199254740992], got '1'"),
    (dict(steps=0), "tokens without steps"),
    (dict(version=None), "version must be an integer in [0, 9007199254740992], got None"),
    (dict(digest="ab"), "digest must be a string of 6..64 characters"),
    (dict(peer=""), "peer must be a string of 1..128 characters"),
    (dict(name=7), "name must be a string of 0..64 characters"),
    (dict(norms=[-0.5]), "norms must be a finite number in [0.0, inf], got -0.5"),
    (dict(blame=["12D3KooWb"] * 65), "blame must be a list of at most 64 peer ids"),
    (dict(blame=[""]), "blame must be a string of 1..128 characters"),
    (dict(**{"pass": "x"}), "pass must be at most 64 bytes"),
    (dict(**{"pass": b"x" * 65}), "pass must be at most 64 bytes"),
    (dict(maxabs=b"\0" * 4), "maxabs must be 16 bytes (fp32 per block)"),
])
def test_a_malformed_members_reason_says_which_field_and_what_it_must_be(change, message):
    expect = Expect(N, n_norms=1) if "norms" in change else EXPECT
    with pytest.raises(Malformed) as e:
        parse_member(good(**change), expect)
    assert str(e.value) == message


def test_the_edges_of_a_member_record_are_accepted():
    edge = good(name="", blame=["12D3KooWb"] * 64, **{"pass": b"x" * 64}, norms=[0.5], budget=0.5)
    m = parse_member(edge, Expect(N, n_norms=1))
    assert m.name == "" and len(m.blame) == 1 and m.credential == b"x" * 64 and m.norms == (0.5,) and m.budget == 0.5
    assert parse_member(good(), EXPECT).credential == b""  # no pass: an empty one
    assert parse_member(good(budget=1e-3), EXPECT).budget == 1e-3


def test_an_island_checks_each_records_sender_and_pass():
    records = [good(peer="12D3KooWa"), good(peer="12D3KooWb"), good(peer="12D3KooWc", **{"pass": b"k" * 32})]
    island = parse_island(records, EXPECT, peer_ids=["12D3KooWa", "12D3KooWx", "12D3KooWc"],
                          admit=lambda peer, credential: credential == b"k" * 32 and peer == "12D3KooWc")
    assert island.rejected == ("no valid pass: it does not hold this swarm's key",
                               "its record claims another peer's id ('12D3KooWb')", "")
    assert [m is None for m in island.members] == [True, True, False]
