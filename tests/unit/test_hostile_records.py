"""What remote peers publish or gather is never trusted: malformed values are dropped, never a crash."""

import math

import pytest

from p2pdiloco.consensus import SKETCH_DIM, consensus_distance
from p2pdiloco.swarm.records import parse_record
from p2pdiloco.timing import agreed_deadline

GOOD = dict(peer="12D3Koo", name="a", version=3, digest="abcdef0123456789", ready=-1, sketch=[0.5] * SKETCH_DIM)


@pytest.mark.parametrize("change", [
    dict(version="3"), dict(digest=None), dict(digest=""), dict(ready=1.5), dict(peer=7),
    dict(sketch=["x"] * 4), dict(sketch=[math.nan]), dict(sketch=[1.0] * (SKETCH_DIM + 1)), dict(sketch="abc"),
    dict(unexpected_field=1),
])
def test_a_malformed_record_is_dropped(change):
    assert parse_record({**GOOD, **change}) is None


def test_well_formed_records_parse_and_give_a_distance():
    a, b = parse_record(GOOD), parse_record({**GOOD, "digest": "ffffff0000000000", "sketch": [1.5] * SKETCH_DIM})
    assert a is not None and b is not None and parse_record(None) is None and parse_record([1, 2]) is None
    assert consensus_distance([(a.version, a.digest, a.sketch), (b.version, b.digest, b.sketch)]) == pytest.approx(8.0)


def test_hostile_budgets_can_neither_hang_nor_cut_short_a_round():
    assert agreed_deadline([5.0, 7.5], cap=60.0) == 7.5
    assert agreed_deadline([5.0, 1e9], cap=60.0) == 60.0  # capped
    for bad in (math.nan, math.inf, -1.0, 0.0, "soon", None):
        assert agreed_deadline([5.0, bad], cap=60.0) == 60.0
    assert agreed_deadline([], cap=60.0) == 60.0
