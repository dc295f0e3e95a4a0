"""The small pure pieces the swarm's decisions lean on: which donor's state a joiner takes, whether a state holds
a merge, what a peer's history and token count may be, who is late twice, what the logs record of a member."""

import pytest
import torch

from p2pdiloco.core.state import (HISTORY, MAX_TAGS, MERGES, GlobalState, contains, lineage_rank, member_tag,
                                  merged_in, parse_history, parse_merges, parse_tokens, sharing_priority)
from p2pdiloco.protocol.island import PenaltyBox, Stragglers
from p2pdiloco.protocol.outcomes import copy_parts
from p2pdiloco.protocol.remote import Member


def test_a_donors_priority_orders_by_version_then_members_then_digest_as_forks_reconcile():
    """hivemind hands a joiner the state of the highest priority: the state peers reconcile to (lineage_rank)."""
    assert sharing_priority(5, 0, "000000") == 5.0
    assert sharing_priority(5, 0, "800000ab") == 5 + 0.5 / (1 << 9)  # six hex digits: half a member
    assert sharing_priority(5, 255, "ffffff") < 6 and sharing_priority(5, 10 ** 6, "ffffff") < 6
    ranks = [(4, 255, "ffffff"), (5, 0, "ffffff"), (5, 1, "000001"), (5, 1, "00a000"), (5, 2, "000000"),
             (5, 3, "0a0000"), (5, 255, "ffffff"), (6, 0, "000000"), ((1 << 20) - 1, 1, "000000"),
             ((1 << 20) - 1, 1, "000001")]
    assert sorted(ranks, key=lambda k: sharing_priority(*k)) == sorted(ranks, key=lambda k: lineage_rank(*k)) == ranks
    assert len({sharing_priority(*k) for k in ranks}) == len(ranks)  # exact: no two ranks share a priority


def test_a_state_contains_a_merge_it_or_its_history_names_and_is_assumed_to_beyond_its_reach():
    meta = dict(version=9, digest="d9", history=[[7, "d7"], [8, "d8"], [9, "d9"]])
    assert contains(meta, (9, "d9")) and contains(meta, (8, "d8")) and contains(meta, [7, "d7"])
    assert not contains(meta, (8, "other")) and not contains(meta, (10, "d10")) and not contains(meta, (7, "x"))
    assert contains(meta, (6, "anything"))  # older than its history reaches: cannot tell, so assume it does
    assert contains(dict(version=3, digest="d3"), (3, "d3")) and not contains(dict(version=3, digest="d3"), (3, "e"))
    assert contains(dict(version=3, digest="d3", history="junk"), (2, "d2"))  # junk history: only itself known


@pytest.mark.parametrize("raw", [None, "x", [[1, "a"], [2]], [[1, 2]], [["1", "a"]], [[1, "a"]] * (HISTORY + 1),
                                 {"1": "a"}])
def test_a_malformed_history_counts_as_none(raw):
    assert parse_history(raw) == []


def test_a_well_formed_history_is_kept_in_order():
    assert parse_history([[1, "a"], (2, "b")]) == [(1, "a"), (2, "b")]
    assert len(parse_history([[i, "a"] for i in range(HISTORY)])) == HISTORY


def test_a_state_names_its_latest_merges_members_and_a_restart_reads_there_whether_its_contribution_is_in_it():
    state = GlobalState(torch.zeros(4), lr=0.7, momentum=0.9)
    for members in (["a", "b"], ["b", "c"], ["c"]):  # v1, v2, v3
        state.apply(torch.ones(4), members)
    metadata, _ = state.snapshot()
    assert parse_merges(metadata["merges"]) == [(1, [member_tag("a"), member_tag("b")]), (2, [member_tag("b"),
                                                member_tag("c")]), (3, [member_tag("c")])]
    assert merged_in(metadata, "a", 0) is True  # merged at v1
    assert merged_in(metadata, "b", 1) is True  # from v1, merged at v2
    assert merged_in(metadata, "a", 1) is False  # v2 and v3 were merged without it: two merges past
    assert merged_in(metadata, "a", 2) is None  # v3 alone without it: its island may be settling a fork at v3
    assert merged_in(metadata, "a", 3) is None and merged_in(metadata, 5, 1) is None  # not past it; not an id
    assert merged_in(dict(metadata, merges=metadata["merges"][1:]), "d", 0) is None  # v1's members not named
    assert merged_in(dict(version=3, digest="x"), "a", 0) is None  # an older peer's state names none
    loaded = GlobalState(torch.zeros(4), lr=0.7, momentum=0.9)
    loaded.load(metadata, [torch.ones(4), torch.zeros(4)])
    assert loaded.merges == state.merges  # a state taken from a peer names what the peer's did
    for i in range(MERGES + 3):
        state.apply(torch.ones(4), [f"m{i}"])
    assert len(state.merges) == MERGES and state.merges[-1] == (state.version, [member_tag(f"m{MERGES + 2}")])


TAG = member_tag("a")


@pytest.mark.parametrize("raw", [None, "x", [[1, [TAG]], [2]], [[1, TAG]], [[1, [2]]], [["1", [TAG]]], {"1": [TAG]},
                                 [[1, [TAG]]] * (MERGES + 1), [[1, ["a"]]], [[1, [TAG] * (MAX_TAGS + 1)]]])
def test_malformed_merges_count_as_none_named(raw):
    assert parse_merges(raw) == []
    assert parse_merges([[1, [TAG] * MAX_TAGS]]) == [(1, [TAG] * MAX_TAGS)]  # the bound itself is well formed
    assert merged_in(dict(version=5, digest="d", merges=raw), "a", 3) is None


@pytest.mark.parametrize("raw, tokens", [(5, 5), (0, 0), (-1, 0), (True, 0), (1.5, 0), ("7", 0), (None, 0),
                                         ((1 << 62) - 1, (1 << 62) - 1), (1 << 62, 0)])
def test_a_remote_token_count_is_a_non_negative_integer_or_zero(raw, tokens):
    assert parse_tokens(raw) == tokens


def test_late_twice_within_the_window_is_late_again_and_once_is_forgiven():
    s = Stragglers(window=10.0)
    assert s.late(["a", "b"], now=0.0) == frozenset()
    assert s.late(["a"], now=5.0) == {"a"}  # b was late once only
    assert s.late(["b"], now=12.0) == frozenset()  # b's first was 12 s ago: outside the window
    assert s.late(["a"], now=14.9) == {"a"}  # a's last was at 5.0: within 10 s
    assert s.late(["a", "b"], now=30.0) == frozenset() and set(s.last) == {"a", "b"} and s.last["a"] == 30.0


def test_blame_lasts_its_seconds_and_the_most_recent_comes_first():
    box = PenaltyBox(seconds=10.0)
    box.blame(["a"], now=0.0)
    box.blame(["b", "c"], now=5.0)
    assert box.active(9.0) == ["b", "c", "a"]  # ties in the order they were blamed
    assert box.active(10.0) == ["b", "c"]  # a's ended at 10.0
    assert box.active(15.0) == [] and box.until == {}


def test_the_logs_record_of_a_member_is_its_identity_and_its_claims_not_its_statistics():
    m = Member(peer="12D3KooWa", name="a", version=4, digest="abcdef", tokens=4096, steps=32, budget=10.0,
               maxabs=b"\0" * 8, block_norms=b"\0" * 8)
    assert m.as_record() == dict(peer="12D3KooWa", name="a", version=4, digest="abcdef", tokens=4096, steps=32)


def test_copy_parts_copies_every_chunk():
    n = (1 << 21) + 17  # two whole chunks and a piece
    source, out = torch.arange(n, dtype=torch.float32), torch.zeros(n)
    copy_parts(source, out)
    assert torch.equal(source, out)


def test_a_dropped_contribution_cannot_be_read_and_a_new_one_holds_its_delta():
    from p2pdiloco.protocol.outcomes import Contribution, Kept

    delta = torch.ones(4)
    c = Contribution.of(delta, tokens=8, steps=2, version=1, peer="p", name="p", digest="abcdef")
    assert c.kept.get() is delta and c.delta is delta
    kept = Kept(torch.zeros(2))
    kept.drop()
    with pytest.raises(ValueError, match="dropped"):
        kept.get()


def test_error_feedback_lets_each_chunk_of_its_residual_go_and_writes_where_it_is_told():
    """A residual kept in a file is paged out a chunk at a time by each pass, and a lone member's update is
    written into the buffer given (the averaging buffer), each chunk released once written."""
    from p2pdiloco.core import codec, exact

    class Recording(codec.VectorStore):
        def __init__(self):
            self.gone = []

        def let_go(self, view):
            self.gone.append(view.numel())

    n = exact._CHUNK + 7
    store = Recording()
    fb = codec.ErrorFeedback(store=store)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    out, released = torch.zeros(n), []
    merged = fb.alone(x, 4, codec.DenseFormat(4, 1), out=out, let_go=released.append)
    assert merged is out and released == [slice(0, exact._CHUNK), slice(exact._CHUNK, n)]
    assert store.gone == [exact._CHUNK, 7]
    store.gone.clear()
    residual = fb.residual
    fb.record_encoded(x, 1.0, codec.agreed_scales([codec.block_maxabs(x)], 4), 4)
    assert fb.residual is residual and store.gone == [exact._CHUNK, 7]  # overwritten in place, paged out
    store.gone.clear()
    fb.compensate(x)
    assert store.gone == [exact._CHUNK, 7]
    assert fb.record(x, x) is None and fb.residual.dtype == torch.float32 and not fb.residual.any()


def test_the_pure_helpers_at_their_defaults():
    from p2pdiloco.core import codec
    from p2pdiloco.core.outer import weighted_merge

    assert contains({"digest": "d"}, (0, "a")) is False  # no version of its own: nothing older than it is known
    assert weighted_merge([torch.tensor([2.0])], [0.5]).tolist() == [1.0]  # a merge of one
    fb = codec.ErrorFeedback()
    x = torch.randn(100, generator=torch.Generator().manual_seed(1))
    fb.alone(x, 4, codec.DenseFormat(4, 1))
    residual = fb.residual
    fb.alone(x, 4, codec.DenseFormat(4, 1))
    assert fb.residual is residual  # overwritten in place: a second model-sized vector is never made
