"""The simulator's two learner-failure models on settings small enough to work by hand, the network times from
sizes, and the round rules from a peer's own configuration."""

import dataclasses
import math

import pytest

from p2pdiloco.config import CHECKPOINT_FLOOR, ConfigError, SwarmConfig
from p2pdiloco.protocol.round import swarm_rules
from p2pdiloco.sim.baselines import simulate_elastic, simulate_sync_diloco
from p2pdiloco.sim.central import simulate_central
from p2pdiloco.sim.decoupled import DecoupledSim, simulate_decoupled
from p2pdiloco.sim.failures import Draws
from p2pdiloco.sim.lifeline import Span, WorkClock, elastic_spans, restart_spans
from p2pdiloco.sim.params import PEER, SimParams
from p2pdiloco.sim.sizes import allreduce_seconds, central_seconds, download_seconds, join_seconds


def test_a_restarting_learner_is_down_for_the_restart_and_a_failure_meanwhile_is_the_same_outage():
    spans = restart_spans([10.0, 12.0, 50.0], chips=8, down=5.0, step=1.0, horizon=100.0)
    assert spans == [Span(0.0, 10.0, 8, died=True), Span(15.0, 50.0, 8, died=True), Span(55.0, 100.0, 8)]
    # a failure mid-step loses the step in progress
    assert restart_spans([10.5], chips=8, down=5.0, step=1.0, horizon=20.0)[0] == Span(0.0, 10.0, 8, died=True)


def test_an_elastic_learner_stalls_drops_a_slice_and_takes_it_back():
    """1000 chips, slices of 256 back after 30 s, downscale 5 s, upscale 2 s; failures at 10, 12 (in the stall:
    its slice drops too, at no extra stall) and 60."""
    spans = elastic_spans([10.0, 12.0, 60.0], chips=1000, slice_chips=256, repair=30.0, downscale=5.0, upscale=2.0,
                          step=1.0, horizon=100.0)
    assert spans == [Span(0.0, 10.0, 1000), Span(15.0, 40.0, 488),  # two slices out
                     Span(44.0, 60.0, 1000),  # the first back at 40 (stall to 42), the second at 42 (stall to 44)
                     Span(65.0, 90.0, 744), Span(92.0, 100.0, 1000)]
    clock = WorkClock(spans)
    assert clock.chip_seconds(0.0, 100.0) == 10 * 1000 + 25 * 488 + 16 * 1000 + 25 * 744 + 8 * 1000
    assert clock.work_at(30.0) == 25.0 and clock.wall_after(5.0, 10.0) == 20.0  # the stall does not count
    assert clock.pieces(5.0, 20.0) == [(5.0, 10.0), (15.0, 20.0)]


HAND = SimParams(chips=1000, learners=1, step_seconds=1.0, inner_steps=10, days=67 / 86400, repair_seconds=5.0,
                 rescale_seconds=5.0, slice_chips=256, model_params=1, latency_ms=0.0, bandwidth_gbit=1e6)
DIES_AT_25 = Draws(failures=((25.0,),), step_seconds=(1.0,))


@pytest.mark.parametrize("simulate", [simulate_decoupled, simulate_central, simulate_sync_diloco])
def test_a_restarted_learner_loses_the_work_since_its_last_checkpoint(simulate):
    """Rounds of 10 s; it dies at 25 and is back at 30. Without a local checkpoint it loses 20-25 and merges
    0-20 and 30-60 (60-67 is unfinished): 50 of 67 s. With one every 3 s it keeps 20-24 (the checkpoint at 24),
    needs 6 s more for that round, and merges 0-24 and 30-66: 60 of 67 s."""
    never = simulate(dataclasses.replace(HAND, failure="restart", checkpoint_seconds=0.0), DIES_AT_25)
    every_3 = simulate(dataclasses.replace(HAND, failure="restart", checkpoint_seconds=3.0), DIES_AT_25)
    assert never.goodput == pytest.approx(50 / 67, rel=1e-6)
    assert every_3.goodput == pytest.approx(60 / 67, rel=1e-6)


@pytest.mark.parametrize("simulate", [simulate_decoupled, simulate_central, simulate_sync_diloco])
def test_an_elastic_learner_keeps_its_progress_and_trains_on_with_fewer_chips(simulate):
    """It stalls 25-30 and trains on with 744 chips until the slice is back at 55. Rounds end at 10, 20, 35, 45,
    55 and 65: merged chip-time 25·1000 + 25·744 + 10·1000 of 67·1000."""
    p = dataclasses.replace(HAND, failure="elastic", repair_seconds=30.0)
    r = simulate(p, DIES_AT_25)
    assert r.goodput == pytest.approx((25 * 1000 + 25 * 744 + 10 * 1000) / 67_000, rel=1e-6)
    # elastic data-parallel: the same learner, every second of work useful
    assert simulate_elastic(p, DIES_AT_25).goodput == pytest.approx((25 * 1000 + 25 * 744 + 12 * 1000) / 67_000,
                                                                       rel=1e-6)


@pytest.mark.parametrize("checkpoint, merged", [(0.0, 40.0), (3.0, 50.0)])
def test_a_learner_killed_mid_all_reduce_fails_the_island_and_keeps_only_what_its_checkpoint_holds(checkpoint,
                                                                                                   merged):
    """Two learners of one chip, rounds of 10 s, all-reduces of 5 s. Their first island closes at 15 (the grace
    window) and exchanges until 20; the second learner dies at 17 and is back at 22. The island fails for both:
    the first's 0-10 rides along into its solo round at 20 (0-20), then it merges 20-30 at 40. Without a local
    checkpoint the second loses 0-17 and merges 22-32: 40 chip-seconds in all. With one every 3 s it keeps
    0-15 (the checkpoint at 15, its failed round's 0-10 included), owes 5 s of its round, and merges 0-15 and
    22-27 at 37 with the first's 20-30: 50. Nothing is counted twice."""
    p = dataclasses.replace(HAND, chips=2, learners=2, failure="restart", sync_seconds=5.0, days=40 / 86400,
                            checkpoint_seconds=checkpoint)
    r = simulate_decoupled(p, Draws(failures=((), (17.0,)), step_seconds=(1.0, 1.0)))
    assert r.details["outcomes"]["rolled_back"] >= 1
    assert r.goodput * p.chips * p.horizon == pytest.approx(merged, rel=1e-9)


def test_the_failure_model_follows_the_learners_size_unless_chosen():
    assert SimParams(chips=1_200_000, learners=8).learner_failure == "elastic"  # the paper's learners
    assert SimParams(chips=5, learners=5).learner_failure == "restart"  # peers of one machine
    assert SimParams(chips=5, learners=5, failure="elastic").learner_failure == "elastic"


def test_network_times_come_from_sizes_and_the_link():
    p = SimParams(model_params=1_000_000_000, compression="int4", bandwidth_gbit=8.0, latency_ms=10.0)
    # a member of 4 sends 3/4 of the codes (4 bits) and 3/4 of the sums (4 codes of 4 bits: 8 bits, a width the
    # lossless stage reads well) at 1 GB/s, in two round trips
    assert allreduce_seconds(p, 4) == pytest.approx(0.75 * 1e9 * (4 + 8) / 8 / 1e9 + 0.04)
    assert allreduce_seconds(p, 1) == 0.0
    assert central_seconds(p) == pytest.approx(2 * 0.5 + 0.02)
    assert download_seconds(p) == pytest.approx(8.0 + 0.02)  # Θ and momentum in fp32
    assert join_seconds(p) == pytest.approx(0.06)
    assert allreduce_seconds(p, 8) > allreduce_seconds(p, 4)  # larger islands move more
    measured = dataclasses.replace(p, sync_seconds=3.5, join_seconds=1.25)
    assert allreduce_seconds(measured, 4) == 3.5 and join_seconds(measured) == 1.25


def test_the_simulated_learners_follow_a_peers_round_rules():
    """The shared settings default to a peer's, and the rules are made by the peer's own function: a setting
    changed in one place changes both."""
    shared = ("quorum", "grace_gamma", "max_staleness", "wait_for_newest", "wait_for_island", "compression")
    sim_defaults = {f.name: f.default for f in dataclasses.fields(SimParams)}
    assert {n: sim_defaults[n] for n in shared} == {n: getattr(SwarmConfig(), n) for n in shared}
    assert PEER == SwarmConfig()
    assert sim_defaults["checkpoint_seconds"] == CHECKPOINT_FLOOR  # a small model's peer checkpoints so often
    p = SimParams(chips=100, learners=4, days=0.01, quorum=3, grace_gamma=0.3, max_staleness=1,
                  wait_for_newest=True, wait_for_island=False)
    rules = DecoupledSim(p, Draws(failures=((),) * 4, step_seconds=(1.0,) * 4)).rules
    peer = swarm_rules(SwarmConfig(quorum=3, grace_gamma=0.3, max_staleness=1, wait_for_newest=True,
                                   wait_for_island=False), overlap_steps=p.inner_steps, grace_floor=join_seconds(p),
                       buffer_elements=0, poll=1.0)
    assert rules == peer
    assert (rules.quorum, rules.grace.gamma, rules.max_staleness, rules.wait_for_newest, rules.wait_for_island,
            rules.overlap_steps, rules.grace.floor, rules.grace.cap) == (3, 0.3, 1, True, False, 100,
                                                                          join_seconds(p), 60.0)
    with pytest.raises(ConfigError, match="max staleness"):
        SimParams(max_staleness=-1)  # the peer's own check


def test_an_outage_that_outlasts_the_horizon_ends_the_learners_work():
    spans = restart_spans([5.0], chips=1, down=1e9, step=1.0, horizon=100.0)
    clock = WorkClock(spans)
    assert clock.next_start(5.0) == math.inf and clock.wall_after(0.0, 10.0) == math.inf
