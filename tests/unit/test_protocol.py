"""Every decision of the round protocol, on a fake clock: no hivemind, no threads, no sleeping."""

import dataclasses
import math

import pytest
import torch

from p2pdiloco.core import exact
from p2pdiloco.protocol.outcomes import Adopted, Committed, Contribution, Left, RolledBack, Solo
from p2pdiloco.protocol.remote import Member, PeerRecord
from p2pdiloco.protocol.round import (Done, Download, FormIsland, IslandFailed, IslandReduced, NoIsland,
                                      ProtocolError, RefreshPeers, Round, RoundRules, WaitForPeers, swarm_rules)
from p2pdiloco.protocol.timing import GracePolicy, RoundClock

ME = "me-peer"


def contribution(version=3, digest="aaaaaa", tokens=100, steps=10, merged_by=0) -> Contribution:
    return Contribution.of(torch.full((8,), 0.5), tokens=tokens, steps=steps, version=version, peer=ME,
                           name="me", digest=digest, merged_by=merged_by)


def record(peer, version=3, digest="aaaaaa", ready=-1, merging=-1, merged_by=0) -> PeerRecord:
    return PeerRecord(peer=peer, name=peer, version=version, digest=digest, ready=ready, merging=merging,
                      merged_by=merged_by)


def member(peer, version=3, digest="aaaaaa", tokens=100, steps=10) -> Member:
    return Member(peer=peer, name=peer, version=version, digest=digest, tokens=tokens, steps=steps, budget=10.0)


def measured_clock() -> RoundClock:
    clock = RoundClock()
    clock.step.update(1.0)
    clock.quorum.update(2.0)
    clock.sync.update(3.0)
    return clock


def new_round(t=100.0, c=None, clock=None, **rules) -> Round:
    rules = dict(dict(overlap_steps=20, grace=GracePolicy(gamma=0.5, floor=2.5, cap=60.0), buffer_elements=8),
                 **rules)
    return Round(RoundRules(**rules), ME, c or contribution(), clock or measured_clock(), t)


def reduced(*members, verified=True, merged=None, weights=None) -> IslandReduced:
    weights = weights or tuple(1.0 / len(members) for _ in members)
    return IslandReduced(verified=verified, reason="ok" if verified else "checksum mismatch", members=members,
                         weights=weights, group_id="g1", sync_seconds=2.0, sync_ended=1234.5, codec_cpu_seconds=0.5,
                         deadline=9.0,
                         merged=torch.full((8,), 0.25) if merged is None else merged)


def to_island(rnd: Round, others, t=101.0) -> FormIsland:
    decision = rnd.start(others, t)
    assert isinstance(decision, WaitForPeers)
    decision = rnd.on_peers(others, t + 1)
    assert isinstance(decision, FormIsland), decision
    return decision


# ---- alone, quorum, grace window ---------------------------------------------------------------------------
def test_a_peer_alone_in_the_swarm_applies_its_own_update():
    rnd = new_round()
    assert isinstance(rnd.start([], 100.5), WaitForPeers)
    done = rnd.on_peers([record(ME)], 101.0)  # its own record is not another peer
    assert isinstance(done, Done) and isinstance(done.outcome, Solo)
    assert done.outcome.committed and done.outcome.seconds == pytest.approx(1.0)
    assert done.outcome.quorum_seconds == pytest.approx(0.5) and done.outcome.weights == [1.0]


def test_a_solo_round_leaves_its_update_to_the_driver_and_never_reads_delta():
    """Δ may wait on disk: reading it whole here would cost a model-sized copy (swarm.rounds writes the solo update
    into its averaging buffer a chunk at a time instead)."""
    c = contribution()
    c.kept.drop()  # any read of Δ now raises
    rnd = new_round(c=c)
    rnd.start([], 100.5)
    done = rnd.on_peers([], 101.0)
    assert isinstance(done.outcome, Solo) and done.outcome.merged is None and done.outcome.members == [c.member]


def test_with_others_alive_the_island_opens_for_the_grace_window_of_eq3():
    rnd = new_round()
    island = to_island(rnd, [record("b", ready=3)])
    assert island.grace == pytest.approx(0.5 * (20 * 1.0 - 2.0 - 3.0))  # γ·(τ·ξ_step − ξ_quorum − ξ_sync)
    assert island.find_timeout == pytest.approx(island.grace + 2 * 2.0 + 2.0)
    assert island.result_timeout > island.find_timeout


def test_the_grace_window_is_clipped_to_its_floor_and_cap():
    slow = measured_clock()
    slow.step.update(100.0)
    assert to_island(new_round(clock=slow), [record("b")]).grace == 60.0
    assert to_island(new_round(clock=RoundClock()), [record("b")]).grace == 2.5


def test_quorum_waits_for_k_minus_one_ready_peers_then_opens_the_island():
    rnd = new_round(quorum=3)
    waiting = rnd.start([record("b"), record("c")], 100.0)
    assert isinstance(waiting, WaitForPeers) and waiting.until == pytest.approx(160.0)
    assert isinstance(rnd.on_peers([record("b", ready=3), record("c")], 101.0), WaitForPeers)
    island = rnd.on_peers([record("b", ready=3), record("c", ready=2)], 104.0)  # stale contributors count
    assert isinstance(island, FormIsland)
    done = rnd.on_island(reduced(member(ME), member("b"), member("c", version=2)), 110.0)
    assert done.outcome.quorum_seconds == pytest.approx(4.0)


def test_the_quorum_wait_ends_at_its_deadline_with_whoever_is_there():
    rnd = new_round(quorum=3)
    waiting = rnd.start([record("b")], 100.0)
    assert isinstance(rnd.on_timer(waiting.until), FormIsland)


def test_a_peer_leaving_while_it_waits_leaves_the_round():
    rnd = new_round(quorum=2)
    rnd.start([record("b")], 100.0)
    done = rnd.on_leaving(101.0)
    assert isinstance(done.outcome, Left) and not done.outcome.committed


# ---- catching up first -------------------------------------------------------------------------------------
def test_a_fork_at_our_version_is_settled_first_by_adopting_the_higher_state():
    rnd = new_round()
    decision = rnd.start([record("b", digest="ffffff")], 100.0)
    assert decision == Download(3, "fork")
    state = (dict(version=3, digest="ffffff"), [torch.zeros(8), torch.zeros(8)])
    assert isinstance(rnd.on_state(state, 101.0), WaitForPeers)
    assert (rnd.c.version, rnd.c.digest) == (3, "ffffff")  # we now contribute from the adopted state
    island = rnd.on_peers([record("b", digest="ffffff")], 101.5)
    assert isinstance(island, FormIsland)
    done = rnd.on_island(NoIsland(), 105.0)
    done = rnd.on_peers([record("b", digest="ffffff")], 105.5)
    assert isinstance(done.outcome, Adopted) and done.outcome.state_before is state


def test_a_commit_adds_to_thetas_token_count_what_the_plan_counted_not_what_members_claim():
    rnd = new_round(quorum=2)
    to_island(rnd, [record("b", ready=3)])
    done = rnd.on_island(dataclasses.replace(reduced(member(ME), member("b", tokens=10 ** 6)), tokens=300), 110.0)
    assert done.outcome.merged_tokens == 300 and done.outcome.record()["tokens_merged"] == 300
    rnd = new_round(quorum=2)
    to_island(rnd, [record("b", ready=3)])
    done = rnd.on_island(reduced(member(ME), member("b", tokens=50)), 110.0)  # a driver with no plan: the claims
    assert done.outcome.merged_tokens == 150
    assert Solo.of(contribution(tokens=70)).merged_tokens == 70


def test_a_lower_fork_is_not_adopted():
    assert isinstance(new_round().start([record("b", digest="000000")], 100.0), WaitForPeers)


def test_at_one_version_the_state_more_members_merged_wins_whatever_the_digests():
    """Two islands merged apart from one version: the pair's state must not win half the time by its digest
    (seen in the chaos run: a stale pair's state taken over four peers' for three rounds)."""
    pair = contribution(digest="ffffff", merged_by=2)
    decision = new_round(c=pair).start([record("b", digest="000000", merged_by=4)], 100.0)
    assert decision == Download(3, "fork")
    four = contribution(digest="000000", merged_by=4)
    assert isinstance(new_round(c=four).start([record("b", digest="ffffff", merged_by=2)], 100.0), WaitForPeers)
    assert isinstance(new_round(c=four).start([record("b", digest="000001", merged_by=4)], 100.0), Download)
    adopted = new_round(c=pair)
    adopted.start([record("b", digest="000000", merged_by=4)], 100.0)
    adopted.on_state((dict(version=3, digest="000000", last_members=["b", "c", "d", "e"]), []), 101.0)
    assert adopted.c.merged_by == 4  # what we now contribute from ranks as the state it is


def test_a_fork_that_shows_only_while_we_wait_for_quorum_is_settled_before_the_island():
    """Our start read records a heartbeat old; an island that merged our version elsewhere a moment before ours
    shows while we wait. Forming our island then would carry the fork into another round (seen in a chaos run:
    a pair's v17 beside three peers' v17, and both merged a v18). Once a round: a download that failed is not
    retried at every poll."""
    pair = contribution(digest="ffffff", merged_by=2)
    rnd = new_round(c=pair, quorum=2)
    assert isinstance(rnd.start([record("b", version=2)], 100.0), WaitForPeers)
    three = record("b", digest="000000", merged_by=3)
    assert rnd.on_peers([three], 100.5) == Download(3, "fork")
    assert isinstance(rnd.on_state((dict(version=3, digest="000000", last_members=["b", "c", "d"]), []), 101.0),
                      WaitForPeers)
    assert (rnd.c.digest, rnd.c.merged_by) == ("000000", 3)
    assert isinstance(rnd.on_peers([dataclasses.replace(three, ready=3)], 101.5), FormIsland)
    failed = new_round(c=pair, quorum=3)
    failed.start([], 100.0)
    assert failed.on_peers([three], 100.5) == Download(3, "fork")
    assert isinstance(failed.on_state(None, 101.0), WaitForPeers)
    assert isinstance(failed.on_peers([three], 101.5), WaitForPeers)  # not a second download
    lower = new_round(c=pair, quorum=3)
    lower.start([], 100.0)
    assert isinstance(lower.on_peers([record("b", digest="000000", merged_by=1)], 100.5), WaitForPeers)


def test_behind_more_than_max_staleness_catches_up_first_and_within_it_contributes_stale():
    assert new_round(max_staleness=2).start([record("b", version=6)], 100.0) == Download(6, "behind")
    assert isinstance(new_round(max_staleness=2).start([record("b", version=5)], 100.0), WaitForPeers)
    assert new_round(mode="sync").start([record("b", version=4)], 100.0) == Download(4, "behind")


def test_with_wait_for_newest_behind_peers_that_are_not_looking_we_wait_for_them_rather_than_fork():
    """We are at v3 and quorum is met by c (also v3, looking), but b already holds v4 and trains: an island of c
    and us would make a second v4. We wait until b looks (we then join its island, a version behind), at most the
    τ steps until b is due again (20 steps of 1 s) and half as much again, then form the island anyway."""
    b_training, c_looking = record("b", version=4), record("c", ready=3)
    rnd = new_round(quorum=2, wait_for_newest=True)
    assert isinstance(rnd.start([b_training, c_looking], 100.0), WaitForPeers)
    assert isinstance(rnd.on_peers([b_training, c_looking], 110.0), WaitForPeers)
    assert isinstance(rnd.on_peers([record("b", version=4, ready=4), c_looking], 111.0), FormIsland)
    rnd = new_round(quorum=2, wait_for_newest=True)
    rnd.start([b_training, c_looking], 100.0)
    assert isinstance(rnd.on_peers([b_training, c_looking], 129.9), WaitForPeers)
    assert isinstance(rnd.on_peers([b_training, c_looking], 130.0), FormIsland)  # b did not come within 1.5 τ steps
    # nobody ahead of us: the island forms at once, as before; and without the rule (the default) at once too
    assert isinstance(to_island(new_round(quorum=2, wait_for_newest=True), [c_looking]), FormIsland)
    rnd = new_round(quorum=2)
    rnd.start([b_training, c_looking], 100.0)
    assert isinstance(rnd.on_peers([b_training, c_looking], 101.0), FormIsland)


def test_an_island_merging_from_our_state_without_us_is_waited_for_not_forked():
    """b and c began an all-reduce from v3 (our state) just before we were ready; d came late too. An island of d
    and us would make a second v4. We wait for theirs; once it merged, we wait for its members to look again (1.5 τ
    steps: 30 s) and join them, or else take their state and roll back: our Δ rides along."""
    b, c = record("b", ready=3, merging=3), record("c", ready=3, merging=3)
    d_late = record("d", ready=3)
    rnd = new_round()
    assert isinstance(rnd.start([b, c, d_late], 100.0), WaitForPeers)
    assert isinstance(rnd.on_peers([b, c, d_late], 105.0), WaitForPeers)
    merged = [record("b", version=4), record("c", version=4), d_late]
    assert isinstance(rnd.on_peers(merged, 106.0), WaitForPeers)  # b and c train on v4: wait for them to look
    assert isinstance(rnd.on_peers(merged, 119.5), WaitForPeers)
    assert isinstance(rnd.on_peers([record("b", version=4, ready=4), merged[1], d_late], 120.0), FormIsland)
    assert rnd.quorum_seconds == pytest.approx(0.5)  # waiting for them is not waiting for quorum (Eq. 3's ξ_quorum)

    rnd = new_round()
    rnd.start([b, c, d_late], 100.0)
    rnd.on_peers([b, c, d_late], 101.0)
    assert isinstance(rnd.on_peers(merged, 106.0), WaitForPeers)
    assert rnd.on_peers(merged, 130.0) == Download(4, "an island merged without us")  # they did not come in time
    state = ({"version": 4, "digest": "bbbbbb"}, [])
    done = rnd.on_state(state, 131.0)
    assert isinstance(done.outcome, Adopted) and done.outcome.state_before is state and not done.outcome.committed
    assert done.outcome.waited_for_island  # in the round's record
    rnd = new_round()
    rnd.start([b, c, d_late], 100.0)
    rnd.on_peers([b, c, d_late], 101.0)
    rnd.on_peers(merged, 130.0)
    assert isinstance(rnd.on_state(None, 131.0).outcome, RolledBack)  # nothing to adopt: roll back as it is


def test_an_island_in_flight_that_failed_or_is_older_or_the_rule_off_lets_us_form_ours():
    b, c, d_late = record("b", ready=3, merging=3), record("c", ready=3, merging=3), record("d", ready=3)
    rnd = new_round()
    rnd.start([b, c, d_late], 100.0)
    assert isinstance(rnd.on_peers([b, c, d_late], 101.0), WaitForPeers)
    assert isinstance(rnd.on_peers([record("b"), record("c"), d_late], 104.0), FormIsland)  # it rolled back
    assert isinstance(to_island(new_round(), [record("b", version=2, ready=2, merging=2), d_late]), FormIsland)
    assert isinstance(to_island(new_round(wait_for_island=False), [b, c, d_late]), FormIsland)
    assert isinstance(to_island(new_round(), [b, d_late]), FormIsland)  # one record alone is no island (a liar?)
    rnd = new_round()
    rnd.start([b, c, d_late], 100.0)
    assert isinstance(rnd.on_peers([b, c, d_late], 159.9), WaitForPeers)
    assert isinstance(rnd.on_peers([b, c, d_late], 160.0), FormIsland)  # never longer than the grace window's cap


def test_a_failed_catch_up_download_goes_on_from_our_own_state():
    rnd = new_round()
    rnd.start([record("b", version=9)], 100.0)
    assert isinstance(rnd.on_state(None, 110.0), WaitForPeers) and rnd.c.version == 3


# ---- island results ----------------------------------------------------------------------------------------
def test_a_verified_island_commits_with_what_was_decided():
    clock = measured_clock()
    rnd = new_round(clock=clock)
    island = to_island(rnd, [record("b", ready=3)])
    done = rnd.on_island(reduced(member(ME), member("b"), weights=(0.25, 0.75)), 120.0)
    o = done.outcome
    assert isinstance(o, Committed) and o.reason == "ok" and not o.stale
    assert [m.peer for m in o.members] == [ME, "b"] and o.weights == [0.25, 0.75]
    assert o.grace_seconds == island.grace and o.deadline_seconds == 9.0 and o.sync_seconds == 2.0
    assert o.sync_ended == 1234.5  # the driver's clock, passed through: the record comes later
    assert o.codec_cpu_seconds == 0.5
    assert o.seconds == pytest.approx(20.0) and o.group_id == "g1"
    assert o.allreduce_bytes_model == 2 * 1 / 2 * 4 * 8  # butterfly of 8 floats between 2
    assert clock.throughput.get() == pytest.approx(o.allreduce_bytes_model / 2.0)


@pytest.mark.parametrize("result, reason", [
    (IslandFailed("TimeoutError: reducer gone"), "all-reduce failed: TimeoutError: reducer gone"),
    (reduced(member(ME), member("b"), verified=False), "round discarded: checksum mismatch"),
    (reduced(member(ME), member("b"), merged=torch.tensor([math.nan] * 8)), "round discarded: merged update is not finite"),
    (IslandReduced(verified=True, reason="ok", members=(), weights=(), merged=torch.zeros(8)), "round discarded: no accepted member"),
])
def test_a_failed_or_unverified_or_non_finite_island_rolls_back(result, reason):
    rnd = new_round()
    to_island(rnd, [record("b")])
    o = rnd.on_island(result, 110.0).outcome
    assert isinstance(o, RolledBack) and not o.committed and o.merged is None and o.reason == reason


@pytest.mark.parametrize("quorum", [1, 2])
def test_an_island_that_merged_only_us_is_no_island_while_others_are_alive(quorum):
    """Its other members were all left out (a stranger's record that did not parse, a blamed member): merging
    alone would fork Θ, so it rolls back (K ≥ 2), or asks whether we are alone (K = 1), as when no island formed.
    A chaos-free CI run once saw a peer commit such an island of one beside a stranger, and fork."""
    rnd = new_round(quorum=quorum)
    to_island(rnd, [record("b", ready=3)])
    alone = IslandReduced(verified=True, reason="ok", members=(member(ME),), weights=(1.0,), group_id="g1",
                          merged=torch.full((8,), 0.25), excluded={"0": "expected a record (dict), got bytes"})
    decision = rnd.on_island(alone, 110.0)
    if quorum == 1:
        assert isinstance(decision, RefreshPeers)
        decision = rnd.on_peers([record("b")], 111.0)
    o = decision.outcome
    assert isinstance(o, RolledBack) and not o.committed and o.merged is None
    assert "the island merged only us" in o.reason and "got bytes" in o.reason


def test_no_island_with_k1_asks_whether_we_are_alone_then_rolls_back_or_goes_solo():
    for others, kind in (([record("b")], RolledBack), ([], Solo)):
        rnd = new_round()
        to_island(rnd, [record("b")])
        assert isinstance(rnd.on_island(NoIsland("no group"), 110.0), RefreshPeers)
        assert isinstance(rnd.on_peers(others, 111.0).outcome, kind)


def test_no_island_with_a_quorum_rolls_back_at_once():
    rnd = new_round(quorum=2)
    rnd.start([record("b", ready=3)], 100.0)
    rnd.on_peers([record("b", ready=3)], 100.5)
    assert isinstance(rnd.on_island(NoIsland(), 110.0).outcome, RolledBack)


def test_a_stale_member_fetches_the_groups_newer_state_after_committing():
    for fetched in ((dict(version=5, digest="bbbbbb"), [torch.ones(8), torch.zeros(8)]), None):
        rnd = new_round()
        to_island(rnd, [record("b", version=4, ready=4)])  # b holds a newer state and is looking
        decision = rnd.on_island(reduced(member(ME), member("b", version=4, digest="bbbbbb")), 110.0)
        assert decision == Download(5, "stale contribution")
        o = rnd.on_state(fetched, 112.0).outcome
        assert isinstance(o, Committed) and o.stale and o.state is fetched and o.merged is not None
        assert o.reason == "ok"
    worded = new_round()  # a driver may word a verified island's reason as it likes: a commit says "ok"
    to_island(worded, [record("b", version=4, ready=4)])
    island = dataclasses.replace(reduced(member(ME), member("b", version=4, digest="bbbbbb")), reason="verified")
    worded.on_island(island, 110.0)
    assert worded.on_state(None, 112.0).outcome.reason == "ok"


def test_a_member_on_a_same_version_fork_fetches_the_state_the_merge_was_applied_to():
    """The merge is applied to the state of the highest (version, digest) among the members: a member whose
    state has that version but another digest (a fork) must not apply it to its own state, which would split the
    island's outcome in two; it fetches the state the others made, as a stale member does. (A fork its records
    showed at the start is settled before the round; this one is seen only in the gathered records.)"""
    rnd = new_round()  # our contribution: version 3, digest aaaaaa
    to_island(rnd, [record("b", version=3, ready=3)])
    decision = rnd.on_island(reduced(member(ME), member("b", version=3, digest="bbbbbb")), 110.0)
    assert decision == Download(4, "stale contribution")
    assert isinstance(rnd.on_state(None, 112.0).outcome, Committed)
    ours = new_round()  # where ours is the highest, we commit onto our own state
    to_island(ours, [record("b", version=3, ready=3)])
    assert isinstance(ours.on_island(reduced(member(ME), member("b", version=3, digest="000000")), 110.0), Done)


def test_the_sync_barrier_waits_for_every_peer_at_our_version_or_one_ahead():
    rnd = new_round(mode="sync", sync_wait=30.0)
    waiting = rnd.start([record("b"), record("c")], 100.0)
    assert waiting.until == pytest.approx(130.0)
    assert isinstance(rnd.on_peers([record("b", ready=3), record("c")], 101.0), WaitForPeers)
    assert isinstance(rnd.on_peers([record("b", ready=3), record("c", ready=3)], 102.0), FormIsland)
    rnd = new_round(mode="sync")
    rnd.start([record("b")], 100.0)
    assert isinstance(rnd.on_peers([record("b"), record("c", version=4)], 101.0), FormIsland)


def test_rda_recombines_the_merged_directions_with_the_members_norms():
    rnd = new_round(rda_segments=((0, 8),))
    to_island(rnd, [record("b")])
    a = Member(**{**member(ME).__dict__, "norms": (2.0,)})
    b = Member(**{**member("b").__dict__, "norms": (4.0,)})
    o = rnd.on_island(reduced(a, b, merged=torch.full((8,), 1.0)), 110.0).outcome
    assert isinstance(o, Committed)
    assert torch.linalg.vector_norm(o.merged).item() == pytest.approx(3.0, rel=1e-5)


def test_an_event_the_round_is_not_waiting_for_is_a_driver_bug():
    rnd = new_round()
    with pytest.raises(ProtocolError):
        rnd.on_island(NoIsland(), 100.0)
    rnd.start([], 100.0)
    with pytest.raises(ProtocolError):
        rnd.on_state(None, 100.0)


def test_a_hostile_member_claiming_a_far_newer_state_is_excluded_and_never_downloaded_from():
    """Gathered records pass the parser first: a member with an impossible claim is excluded from the merge (weight
    0) with its reason, so it can neither take a share nor make the honest members fetch a state from it."""
    from p2pdiloco.core import exact
    from p2pdiloco.protocol.island import plan_island
    from p2pdiloco.protocol.remote import Expect, parse_island

    maxabs = exact.block_maxabs(torch.ones(8)).numpy().tobytes()
    honest = dict(peer=ME, name="me", version=3, digest="aaaaaa", tokens=100, steps=10, budget=5.0, norms=[],
                  maxabs=maxabs, block_norms=maxabs)
    hostile = dict(honest, peer="evil", name="evil", version=2 ** 60, digest="zzzzzz", tokens=10 ** 30)
    island = parse_island([honest, hostile, dict(honest, peer="b", name="b")], Expect(8))
    plan = plan_island(island, "tokens2", 60.0, 8)
    assert plan.weights == [0.5, 0.0, 0.5] and "1" in island.excluded_by_index()
    rnd = new_round()
    to_island(rnd, [record("b"), record("evil")])
    done = rnd.on_island(IslandReduced(verified=True, reason="ok", members=tuple(island.accepted),
                                       weights=(0.5, 0.5), merged=torch.zeros(8),
                                       excluded=island.excluded_by_index()), 110.0)
    assert isinstance(done, Done) and isinstance(done.outcome, Committed) and not done.outcome.stale
    assert [m.peer for m in done.outcome.members] == [ME, "b"] and "must be an integer" in done.outcome.excluded["1"]


def test_the_finiteness_check_tells_the_driver_each_chunk_of_the_merged_update_it_read():
    """A driver whose merged update lives in a file lets each chunk's pages go as the check reads it
    (p2pdiloco.runtime.paging); the committed outcome hands the same release on to the outer step."""
    chunk = exact._CHUNK
    n = chunk * 2 + 7  # three chunks of exact.chunks
    read = []
    rnd = new_round(buffer_elements=n)
    to_island(rnd, [record("b", ready=3)])
    r = dataclasses.replace(reduced(member(ME), member("b"), merged=torch.zeros(n)), let_go=read.append)
    o = rnd.on_island(r, 120.0).outcome
    assert isinstance(o, Committed) and o.let_go == read.append
    assert [(p.start, p.stop) for p in read] == [(0, chunk), (chunk, 2 * chunk), (2 * chunk, n)]


# ---- what each outcome says, and carries --------------------------------------------------------------------
def test_catching_up_contributes_from_the_downloaded_states_version_and_digest():
    rnd = new_round(max_staleness=2)
    assert rnd.start([record("b", version=6, digest="bbbbbb")], 100.0) == Download(6, "behind")
    state = (dict(version=6, digest="bbbbbb"), [torch.zeros(8), torch.zeros(8)])
    assert isinstance(rnd.on_state(state, 101.0), WaitForPeers)
    assert (rnd.c.version, rnd.c.digest) == (6, "bbbbbb") and rnd.state_before is state
    stays = new_round(max_staleness=2)  # the download failed: we go on from our own state
    stays.start([record("b", version=6)], 100.0)
    assert isinstance(stays.on_state(None, 101.0), WaitForPeers) and (stays.c.version, stays.c.digest) == (3, "aaaaaa")


def test_each_way_a_round_ends_says_so_in_its_reason():
    rnd = new_round(quorum=2)
    rnd.start([record("b")], 100.0)
    assert rnd.on_leaving(101.0).outcome.reason == "leaving"
    rnd = new_round(quorum=2)
    rnd.start([record("b")], 100.0)
    assert rnd.on_leaving(101.0, "SIGTERM").outcome.reason == "SIGTERM"
    alone = new_round()
    alone.start([], 100.0)
    done = alone.on_peers([], 101.0)
    assert isinstance(done, Done) and isinstance(done.outcome, Solo) and alone.phase == "done"
    stale = new_round()  # the merge was applied to b's newer state: we take it, the island's reason kept
    to_island(stale, [record("b", version=4, ready=4)])
    stale.on_island(reduced(member(ME), member("b", version=4, digest="bbbbbb")), 110.0)
    assert stale.on_state(None, 112.0).outcome.reason == "ok"


def test_an_island_that_merged_without_us_is_adopted_or_rolled_back_with_its_reason():
    """b and c merged v3 → v4 without us while we waited for their island; we ask for their state: taken, the
    round says which version it took; not downloaded, it says so."""
    b, c, d_late = record("b", ready=3, merging=3), record("c", ready=3, merging=3), record("d", ready=3)
    merged = [record("b", version=4), record("c", version=4), d_late]
    for state, kind, reason in (
            ((dict(version=4, digest="cccccc"), [torch.zeros(8), torch.zeros(8)]), Adopted,
             "rolled back: an island merged from v3 without us; took its state v4"),
            (None, RolledBack, "rolled back: an island merged without us, and its state did not download")):
        rnd = new_round()
        rnd.start([b, c, d_late], 100.0)
        rnd.on_peers([b, c, d_late], 101.0)
        assert rnd.on_peers(merged, 130.0) == Download(4, "an island merged without us")
        o = rnd.on_state(state, 131.0).outcome
        assert type(o) is kind and o.reason == reason


def test_the_wait_for_a_newer_peer_is_one_and_a_half_overlaps_of_our_measured_step():
    """τ = 20 steps of 0.5 s (measured): b is due within 15 s; capped by the grace window's cap."""
    clock = RoundClock()
    clock.step.update(0.5)
    b_training, c_looking = record("b", version=4), record("c", ready=3)
    rnd = new_round(quorum=2, wait_for_newest=True, clock=clock)
    rnd.start([b_training, c_looking], 100.0)
    assert isinstance(rnd.on_peers([b_training, c_looking], 114.9), WaitForPeers)
    assert isinstance(rnd.on_peers([b_training, c_looking], 115.0), FormIsland)
    capped = new_round(quorum=2, wait_for_newest=True, clock=clock, overlap_steps=1000,
                       grace=GracePolicy(gamma=0.5, floor=2.5, cap=40.0))
    capped.start([b_training, c_looking], 100.0)
    assert isinstance(capped.on_peers([b_training, c_looking], 139.9), WaitForPeers)
    assert isinstance(capped.on_peers([b_training, c_looking], 140.0), FormIsland)


def test_an_outcome_carries_what_the_island_said_committed_or_not():
    """The round's record (metrics, `report`) shows each of these: a committed round all of them, one rolled back
    what its island did before it failed."""
    def island(verified):
        return dataclasses.replace(reduced(member(ME), member("b"), verified=verified, weights=(0.5, 0.5)),
                                   excluded={"c": "malformed"}, bounded={"b": "merge weight capped"})

    for verified, kind in ((True, Committed), (False, RolledBack)):
        rnd = new_round()
        to_island(rnd, [record("b", ready=3)])
        o = rnd.on_island(island(verified), 120.0).outcome
        assert type(o) is kind and rnd.phase == "done"
        assert (o.group_id, o.sync_seconds, o.sync_ended, o.deadline_seconds, o.codec_cpu_seconds) == \
            ("g1", 2.0, 1234.5, 9.0, 0.5)
        assert o.excluded == {"c": "malformed"} and o.bounded == {"b": "merge weight capped"}
        assert (o.members != []) == verified and (o.merged is not None) == verified


def test_while_waiting_the_round_announces_its_version_and_how_often_to_look():
    rnd = new_round(quorum=2, poll=0.5)
    w = rnd.start([record("b")], 100.0)
    assert w == WaitForPeers(3, 160.0, 0.5)  # the quorum wait's cap
    b_training = record("b", version=4)  # a newer peer is due in 1.5 τ steps (30 s): look again then
    rnd = new_round(quorum=2, wait_for_newest=True)
    rnd.start([b_training, record("c", ready=3)], 100.0)
    assert rnd.on_peers([b_training, record("c", ready=3)], 101.0) == WaitForPeers(3, 130.0, 0.25)
    due_late = new_round(quorum=2, wait_for_newest=True, grace=GracePolicy(gamma=0.5, floor=2.5, cap=20.0))
    due_late.start([b_training, record("c", ready=3)], 100.0)
    assert due_late.on_peers([b_training, record("c", ready=3)], 101.0).until == 120.0  # the cap comes first
    sync = new_round(quorum=2, mode="sync", sync_wait=50.0, wait_for_newest=True)
    sync.start([record("c")], 100.0)
    assert sync.on_peers([record("c")], 101.0).until == 150.0  # the barrier's own wait, whatever the rule


@pytest.mark.parametrize("peer, may", [
    (record("b", version=5), True), (record("b", version=4), False),  # holds it, or an older one
    (record("b", version=4, merging=4), True), (record("b", version=4, merging=3), False),  # makes v5, or v4
    (record("b", version=0, merging=0), False), (dataclasses.replace(record("b", version=5), client_mode=True), False),
])
def test_a_state_may_come_from_a_peer_that_holds_or_makes_it_and_can_be_dialed(peer, may):
    from p2pdiloco.protocol.round import state_may_come

    assert state_may_come([peer], 5) is may
    assert state_may_come([record("z", version=0, merging=0)], 1) is True  # merging from v0 makes v1


def test_the_island_is_formed_with_its_timeouts_and_an_all_reduce_budget_from_the_link_speed():
    """grace (Eq. 3) 0.5 × (20 steps of 1 s − 2 s quorum − 3 s sync) = 7.5 s, find: grace + 2 × 2 s request
    timeouts + 2 = 13.5 s, the whole round 60 s more and 5 of margin; the budget: 3 s + 3 × what a 16-member
    butterfly of 8 floats moves at the measured 12 bytes/s."""
    clock = measured_clock()
    clock.throughput.update(12.0)
    rnd = new_round(clock=clock)
    island = to_island(rnd, [record("b", ready=3)])
    wire = 2 * 15 / 16 * 4 * 8
    assert island == FormIsland(7.5, 13.5, 78.5, 3.0 + 3.0 * wire / 12.0)
    assert rnd.island is island and rnd.phase == "island"


def test_an_island_that_merged_only_us_names_whom_it_left_out():
    for excluded, said in (({"1": "malformed", "2": "blamed", "3": "malformed"}, "blamed; malformed"),
                           ({}, "none named"), ({"1": "x" * 300}, "x" * 200)):
        rnd = new_round(quorum=2)
        to_island(rnd, [record("b", ready=3)])
        alone = dataclasses.replace(reduced(member(ME)), excluded=excluded)
        o = rnd.on_island(alone, 110.0).outcome
        assert o.reason == f"all-reduce failed: the island merged only us (the others left out: {said})"


def test_the_wire_bytes_of_an_all_reduce_are_a_butterflys():
    from p2pdiloco.protocol.timing import allreduce_wire_bytes

    assert allreduce_wire_bytes(1000, 1) == 0 and allreduce_wire_bytes(1000, 0) == 0
    assert allreduce_wire_bytes(1000, 2) == 4000 and allreduce_wire_bytes(1000, 4) == 6000
    assert allreduce_wire_bytes(1000, 4, bytes_per_element=1) == 1500


def test_round_edges_the_mutants_found():
    """Each assertion fails on a one-line change that every other test let pass (scripts/bench/mutation.sh)."""
    from p2pdiloco.protocol.round import ProtocolError

    # a verified island's reason becomes "ok"; a sync of under a second still measures the link
    clock = measured_clock()
    rnd = new_round(clock=clock)
    to_island(rnd, [record("b", ready=3)])
    r = dataclasses.replace(reduced(member(ME), member("b")), reason="verified", sync_seconds=0.5)
    o = rnd.on_island(r, 120.0).outcome
    assert o.reason == "ok" and o.waited_for_island is False
    assert clock.throughput.get() == pytest.approx(o.allreduce_bytes_model / 0.5)
    # malformed RDA norms roll the round back, saying so
    rda = new_round(rda_segments=((0, 4), (4, 8)))
    to_island(rda, [record("b", ready=3)])
    o = rda.on_island(reduced(member(ME), member("b")), 120.0).outcome  # members sent no norms
    assert isinstance(o, RolledBack) and o.reason.startswith("round discarded: malformed RDA norms (")
    # a solo round has no grace window; a round asked out of turn names both phases
    alone = new_round()
    alone.start([], 100.0)
    assert alone.on_peers([], 101.0).outcome.grace_seconds == 0.0
    with pytest.raises(ProtocolError, match=r"^round is in phase 'done', not 'island'$"):
        alone.on_island(NoIsland(), 102.0)
    # with a quorum of 2 and nobody else, the round waits for its deadline, then looks for an island anyway
    lonely = new_round(quorum=2, sync_wait=5.0)
    assert lonely.start([], 100.0).until == 160.0  # not the sync barrier's wait
    assert isinstance(lonely.on_peers([], 160.0), FormIsland)
    # peers looking from version 0 count toward the quorum, and an island merging from version 0 is in flight
    zero = new_round(quorum=2, c=contribution(version=0))
    zero.start([record("b", version=0, ready=0)], 100.0)
    assert isinstance(zero.on_peers([record("b", version=0, ready=0)], 100.5), FormIsland)
    flight = new_round(c=contribution(version=0))
    b, c, d = (record("b", version=0, ready=0, merging=0), record("c", version=0, ready=0, merging=0),
               record("d", version=0, ready=0))
    flight.start([b, c, d], 100.0)
    assert isinstance(flight.on_peers([b, c, d], 104.0), WaitForPeers)  # b and c's island from v0 is in flight
    merged = [record("b", version=1), record("c", version=1), d]
    assert isinstance(flight.on_peers(merged, 105.0), WaitForPeers)
    assert isinstance(flight.on_peers([record("b", version=1, ready=1), merged[1], d], 106.0), FormIsland)
    assert flight.quorum_seconds == pytest.approx(1.0)  # 6 s, less the 5 s spent waiting for their island
    at_once = new_round(c=contribution(version=0))
    at_once.start([b, c, d], 100.0)
    at_once.on_peers([b, c, d], 104.0)  # their island is in flight: 4 s of waiting that is not for quorum
    looking = [record("b", version=1, ready=1), record("c", version=1, ready=1), d]
    assert isinstance(at_once.on_peers(looking, 106.0), FormIsland)  # its members look again at once
    assert at_once.quorum_seconds == pytest.approx(2.0)


def test_every_setting_of_a_peers_configuration_reaches_its_round_rules():
    """swarm_rules is the one place a peer's settings become rules, for the hivemind driver and the simulator:
    each setting, set off its default here, arrives where a round reads it, and the driver's limits pass through."""
    from p2pdiloco.config import SwarmConfig
    cfg = SwarmConfig(mode="sync", quorum=3, max_staleness=1, sync_wait=12.0, wait_for_newest=True,
                      wait_for_island=False, max_island=5, grace_gamma=0.3)
    rules = swarm_rules(cfg, overlap_steps=7, grace_floor=2.5, grace_cap=9.0, poll=0.5, buffer_elements=11)
    assert rules == RoundRules(mode="sync", quorum=3, max_staleness=1, sync_wait=12.0, wait_for_newest=True,
                               wait_for_island=False, overlap_steps=7, max_island=5,
                               grace=GracePolicy(gamma=0.3, floor=2.5, cap=9.0), poll=0.5, buffer_elements=11)
    assert rules != RoundRules() and swarm_rules(cfg, overlap_steps=7, grace_floor=2.5).grace.cap == 60.0
