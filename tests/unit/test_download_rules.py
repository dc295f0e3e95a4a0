"""The rules of a state download (p2pdiloco.protocol.download), on a fake clock: whom to ask, what to take, when
to retry and when to give up, with no network and no sleeping."""

import dataclasses
import math

import torch

from p2pdiloco.core.exact import digest
from p2pdiloco.core.reach import RefusedKeys
from p2pdiloco.protocol.download import RETRY_SECONDS, GiveUp, Retry, StateDownload, state_donors
from p2pdiloco.protocol.island import PenaltyBox
from p2pdiloco.protocol.remote import PeerRecord

N = 64


def record(peer: str, version: int, digest_: str = "aaaaaa", client: bool = False, merging: int = -1) -> PeerRecord:
    return PeerRecord(peer=peer, name=peer, version=version, digest=digest_, client_mode=client, merging=merging)


def state(version: int, value: float = 1.0):
    tensors = [torch.full((N,), value), torch.zeros(N)]
    return dict(version=version, digest=digest(*tensors)), tensors


def rules(min_version: int = 5, deadline: float = 100.0, too_far=None, gone_after: float = 6.0, seen=None):
    def why_not_adopt(metadata, tensors, corroborated):
        if seen is not None:
            seen.append(corroborated)
        return too_far
    return StateDownload(min_version, N, deadline, RefusedKeys(), PenaltyBox(), why_not_adopt, gone_after)


def test_donors_are_every_dialable_peer_of_the_best_key_but_refused_keys():
    records = [record("a", 5), record("b", 5), record("c", 4), record("n", 9, client=True), record("x", 7, "ffffff")]
    download = rules()
    assert download.donors(records, 0.0) == ((7, "ffffff"), ["x"])
    download.refused.refuse((7, "ffffff"), 0.0)
    assert download.donors(records, 1.0) == ((5, "aaaaaa"), ["a", "b"])
    assert download.donors(records, 700.0) == ((7, "ffffff"), ["x"])  # a refusal lasts 10 minutes
    assert state_donors([record("c", 4)], 5) is None


def test_at_one_version_the_donors_are_those_of_the_state_more_members_merged():
    four = [dataclasses.replace(record(p, 5, "000000"), merged_by=4) for p in "abcd"]
    pair = [dataclasses.replace(record(p, 5, "ffffff"), merged_by=2) for p in "ef"]
    assert state_donors(pair + four, 0) == ((5, "000000"), ["a", "b", "c", "d"])
    assert state_donors(pair + four[:1], 0) == ((5, "000000"), ["a"])
    assert state_donors(pair + [record("g", 6)], 0) == ((6, "aaaaaa"), ["g"])  # a newer version first


def test_a_state_is_taken_only_whole_valid_new_enough_and_within_reach():
    download = rules()
    assert download.judge(None, [], [], 0.0) == "no peer shared its state"
    assert "older than ours" in download.judge(state(4), ["a"], [], 0.0)
    metadata, tensors = state(6)
    assert "digest" in download.judge((dict(metadata, digest="forged"), tensors), ["a"], [], 0.0)
    assert "NaN" in download.judge(state(6, math.nan), ["a"], [], 0.0)
    assert download.judge(state(6), ["a"], [record("a", 6)], 0.0) is None


def test_a_state_is_corroborated_by_two_donors_or_by_every_live_peer():
    seen = []
    download = rules(seen=seen)
    live = [record("a", 6), record("b", 6), record("c", 3)]
    download.judge(state(6), ["a", "b"], live, 0.0)  # two donors
    download.judge(state(6), ["a"], live, 0.0)  # one of three live peers
    download.judge(state(6), ["a"], live[:1], 0.0)  # the only live peer
    download.judge(state(6), [], live, 0.0)  # hivemind's one-donor download names nobody
    assert seen == [True, False, True, False]


def test_a_state_too_far_from_ours_is_refused_its_key_remembered_and_its_donors_blamed():
    download = rules(too_far="further than 2 versions explain")
    loaded = state(6)
    key = (6, loaded[0]["digest"])
    assert download.judge(loaded, ["liar"], [record("liar", 6)], 10.0) == "refused: further than 2 versions explain"
    assert key in download.refused.active(10.0) and download.penalties.active(10.0) == ["liar"]
    assert download.refusals == ["refused state v6 from ['liar']: further than 2 versions explain"]
    assert download.judge(loaded, ["liar"], [], 11.0) == "state v6 was refused before"
    assert not download.may_fetch_whole(((6, "x"), ["other"]), keyed_swarm=False)  # it would pick the liar again


def test_hiveminds_one_donor_download_only_without_a_key_and_while_some_peer_holds_the_version():
    download = rules()
    assert download.may_fetch_whole(((6, "x"), ["a"]), keyed_swarm=False)
    assert not download.may_fetch_whole(((6, "x"), ["a"]), keyed_swarm=True)
    assert not download.may_fetch_whole(None, keyed_swarm=False)


def test_a_failure_is_retried_until_the_deadline_or_the_peer_leaves():
    download = rules(deadline=30.0)
    holders = [record("a", 6)]
    assert download.after_failure("a donor died", holders, 10.0, leaving=False) == Retry(RETRY_SECONDS)
    assert download.after_failure("a donor died", holders, 10.0, leaving=True) == GiveUp("a donor died")
    assert download.after_failure("a donor died", holders, 30.0, leaving=False) == GiveUp("a donor died")


def test_after_a_refusal_it_gives_up_at_once_when_nobody_else_holds_the_version():
    download = rules(too_far="too far")
    loaded = state(6)
    liar = record("liar", 6, loaded[0]["digest"])
    download.judge(loaded, ["liar"], [liar], 0.0)
    assert download.after_failure("refused: too far", [liar], 1.0, leaving=False) == \
        GiveUp("refused: too far; no other peer holds v5 or later")
    honest = record("honest", 5, "bbbbbb")
    assert download.after_failure("refused: too far", [liar, honest], 1.0, leaving=False) == Retry(RETRY_SECONDS)


def test_once_no_live_peer_holds_or_makes_the_version_for_a_records_life_it_gives_up():
    download = rules(min_version=7, deadline=1000.0, gone_after=6.0)
    behind = [record("b", 5), record("c", 6, client=True)]  # c holds it, but nobody can dial c
    assert download.after_failure("x", behind, 0.0, leaving=False) == Retry(RETRY_SECONDS)
    assert download.after_failure("x", behind, 6.0, leaving=False) == Retry(RETRY_SECONDS)
    making = [record("b", 6, merging=6)]  # an island in flight may make v7: the clock starts again
    assert download.after_failure("x", making, 6.5, leaving=False) == Retry(RETRY_SECONDS)
    assert download.after_failure("x", behind, 7.0, leaving=False) == Retry(RETRY_SECONDS)
    assert download.after_failure("x", behind, 13.5, leaving=False) == \
        GiveUp("x; no live peer holds v7 or later, nor is making it")
    on_a_real_clock = rules(min_version=7, deadline=1e9, gone_after=6.0)  # time.monotonic() reads far from 0
    assert on_a_real_clock.after_failure("x", behind, 5000.0, leaving=False) == Retry(RETRY_SECONDS)
    assert on_a_real_clock.after_failure("x", behind, 5003.0, leaving=False) == Retry(RETRY_SECONDS)
    assert isinstance(on_a_real_clock.after_failure("x", behind, 5006.5, leaving=False), GiveUp)
