"""The goodput simulator: sanity limits, the decoupled mode against sync DiLoCo, monotonicity, determinism,
and the datacenter-scale run it exists for."""

import dataclasses
import functools
import json
import time

import pytest
from click.testing import CliRunner

from p2pdiloco.cli import cli
from p2pdiloco.config import ConfigError
from p2pdiloco.sim.params import MODES, SimParams
from p2pdiloco.sim.run import simulate

SMALL = SimParams(chips=120_000, learners=4, days=2.0)  # a failure every ~4 minutes: fast, still failure-heavy
NO_FAILURES = dict(mtbi_years=1e12)


@pytest.mark.parametrize("mode", MODES)
def test_without_failures_every_mode_has_goodput_1(mode):
    p = dataclasses.replace(SMALL, sync_seconds=0.0, **NO_FAILURES)
    r = simulate(p, mode)
    assert r.failures == 0
    assert r.goodput == pytest.approx(1.0, abs=1e-3) and r.uptime == pytest.approx(1.0, abs=1e-3)


def test_without_failures_decoupled_overlaps_the_sync_that_sync_diloco_waits_for():
    p = dataclasses.replace(SMALL, sync_seconds=5.0, **NO_FAILURES)
    assert simulate(p, "decoupled").goodput == pytest.approx(1.0, abs=1e-3)
    assert simulate(p, "sync-diloco").goodput == pytest.approx(100 / 105, abs=1e-3)


@pytest.mark.parametrize("seed, mtbi, failure, checkpoint", [(0, 1.0, "elastic", 0.0), (1, 0.25, "restart", 0.0),
                                                             (2, 4.0, "restart", 30.0)])
def test_one_learner_decoupled_is_sync_diloco(seed, mtbi, failure, checkpoint):
    p = dataclasses.replace(SMALL, learners=1, seed=seed, mtbi_years=mtbi, failure=failure,
                            checkpoint_seconds=checkpoint)
    a, b = simulate(p, "decoupled"), simulate(p, "sync-diloco")
    assert a.failures == b.failures > 0
    assert (a.goodput, a.uptime, a.rounds) == (b.goodput, b.uptime, b.rounds)


@pytest.mark.parametrize("mode", MODES)
def test_goodput_falls_as_failures_become_more_frequent(mode):
    goodputs = [simulate(dataclasses.replace(SMALL, mtbi_years=y), mode).goodput for y in (8.0, 2.0, 0.5, 0.125)]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > goodputs[-1]


def test_a_seed_gives_the_same_run_and_another_seed_another():
    a, b = simulate(SMALL, "decoupled"), simulate(SMALL, "decoupled")
    assert a.as_dict() == b.as_dict()
    assert simulate(dataclasses.replace(SMALL, seed=7), "decoupled").as_dict() != a.as_dict()


def test_decoupled_learners_keep_the_global_model_advancing_while_others_are_repaired():
    p = dataclasses.replace(SMALL, learners=8)
    decoupled, sync = simulate(p, "decoupled"), simulate(p, "sync-diloco")
    assert decoupled.uptime > 0.95 > sync.uptime
    assert decoupled.goodput > sync.goodput
    assert decoupled.details["outcomes"].get("committed", 0) > 0  # islands of several learners formed


@functools.lru_cache(maxsize=None)
def decoupled(p: SimParams):
    """The decoupled mode's result, once per setting: the fork tests below compare the same runs."""
    return simulate(p, "decoupled")


RESTARTING = dataclasses.replace(SMALL, failure="restart", checkpoint_seconds=0.0)  # they die and come back behind


def test_learners_that_find_an_island_merging_without_them_wait_for_it_fork_less_and_keep_their_goodput():
    """A learner ready just after an island at its version closed (its all-reduce had begun) formed an island with
    whoever else came late: a second state at that version. With --wait-for-island (the default) it waits for that
    island, then for its members' next one. Simulated 2 days, 4 restarting learners: K=1 316 -> 44 forks, K=2
    146 -> 4."""
    for p in (RESTARTING, dataclasses.replace(RESTARTING, quorum=2)):
        forking, waiting = decoupled(dataclasses.replace(p, wait_for_island=False)), decoupled(p)
        assert forking.details["forks"] > 20 and waiting.details["forks"] < forking.details["forks"] / 3
        assert waiting.goodput > forking.goodput - 0.002


def test_learners_that_wait_for_a_newer_state_fork_less_and_with_quorum_2_lose_no_goodput():
    """A learner behind peers that train on a newer state (it missed their island: a failure, a slow round) forms
    its own island at its version, a second state beside theirs. With --wait-for-newest it waits for them to look
    and joins their next island a version behind."""
    forking, waiting = decoupled(RESTARTING), decoupled(dataclasses.replace(RESTARTING, wait_for_newest=True))
    assert forking.details["forks"] > 20 and waiting.details["forks"] < forking.details["forks"] / 3
    assert waiting.goodput > forking.goodput - 0.03  # with K=1: a point or less (a waiting round's work rides on)
    p = dataclasses.replace(RESTARTING, quorum=2)
    forking, waiting = decoupled(p), decoupled(dataclasses.replace(p, wait_for_newest=True))
    assert waiting.details["forks"] <= forking.details["forks"] and waiting.goodput > forking.goodput - 0.002


def test_datacenter_scale_two_days_of_1_2m_chips_in_every_mode_within_a_minute():
    started = time.monotonic()
    result = CliRunner().invoke(cli, ["simulate", "--chips", "1200000", "--learners", "16", "--mtbi-years", "1",
                                      "--days", "2", "--mode", "all", "--json"])
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.output
    modes = json.loads(result.output)["modes"]
    assert set(modes) == set(MODES) and all(0.0 < m["goodput"] <= m["uptime"] <= 1.0 for m in modes.values())
    # one failure trace for every mode (the seed's): two days of 1.2M chips at 1 year each is ~6,570 failures
    assert len({m["failures"] for m in modes.values()}) == 1 and 6_000 < modes["dp"]["failures"] < 7_200
    # data-parallel stops everyone at each failure, and does nothing but compute while up
    assert modes["dp"]["goodput"] == modes["dp"]["uptime"] < modes["elastic"]["uptime"]
    # learners that go on while one is repaired keep chips busier than any mode that waits for everyone
    assert modes["decoupled"]["uptime"] > max(modes[m]["uptime"] for m in ("dp", "elastic", "sync-diloco"))
    assert modes["decoupled"]["rounds"] > modes["sync-diloco"]["rounds"] > 0 == modes["dp"]["rounds"]
    # the paper's setting (learners of 75,000 chips: its elastic failure model): 93 % at M = 16, and the price of
    # having no central synchronizer within 2 points
    assert modes["decoupled"]["failure"] == "elastic"
    assert modes["decoupled"]["goodput"] >= 0.93 > modes["elastic"]["goodput"]
    assert modes["decoupled"]["goodput"] >= modes["central"]["goodput"] - 0.02
    assert elapsed < 60.0


def test_simulate_prints_a_table_json_and_a_plot(tmp_path):
    runner = CliRunner()
    args = ["simulate", "--chips", "10000", "--learners", "2", "--days", "0.5"]
    table = runner.invoke(cli, args)
    assert table.exit_code == 0 and all(mode in table.output for mode in MODES)
    one = json.loads(runner.invoke(cli, [*args, "--mode", "decoupled", "--json"]).output)
    assert {"goodput", "uptime"} <= one.keys() and one["mode"] == "decoupled"
    png = tmp_path / "goodput.png"
    result = runner.invoke(cli, [*args, "--plot", str(png)])
    assert result.exit_code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--learners", "0"], "learners must be a positive integer"),
    (["--chips", "4", "--learners", "8"], "cannot exceed chips"),
    (["--mtbi-years", "-1"], "mtbi years must be a positive number"),
    (["--mode", "magic"], "Invalid value for '--mode'"),
    (["--failure", "magic"], "Invalid value for '--failure'"),
    (["--bandwidth-gbit", "0"], "bandwidth gbit must be a positive number"),
    (["--max-staleness", "-1"], "max staleness must be an integer >= 0"),
])
def test_bad_simulator_flags_are_clear_errors(args, message):
    result = CliRunner().invoke(cli, ["simulate", *args])
    assert result.exit_code == 2 and message in result.output


def test_the_simulators_learners_reconcile_forks_by_the_peers_order():
    """At one version the state more learners merged is the one a record ranks first and a download hands out,
    as for peers (p2pdiloco.core.state.lineage_rank): the simulator must not keep a rule of its own."""
    from p2pdiloco.sim.decoupled import DecoupledSim
    from p2pdiloco.sim.failures import draw

    sim = DecoupledSim(SMALL, draw(SMALL))
    pair, four = sim.learners[:2]
    pair.version, pair.digest, pair.last_members = 3, "v3-i9", ["learner0", "learner1"]
    four.version, four.digest, four.last_members = 3, "v3-i1", ["learner1", "a", "b", "c"]
    assert (pair.record().merged_by, four.record().merged_by) == (2, 4)
    for x in sim.learners[2:]:
        x.up = False
    metadata, _ = sim._state_at_least(0, 3)
    assert (metadata["digest"], len(metadata["last_members"])) == ("v3-i1", 4)


def test_the_simulator_drives_fragments_and_a_learner_restarted_out_of_phase_merges_with_the_others_again():
    """--fragments P: each learner is P lanes, each a swarm of its own to the protocol, on one work clock. After a
    restart a learner's fragments are due at its own steps, out of phase with the others', and a fragment's grace
    window (τ·H/P steps) is too short to bridge that: it found no island round after round (goodput 0.873, 88 % of
    the live learners merged per step) until its fragments went along with the others' islands once they had half
    a round of steps (`Stagger.joins_early`), as a peer's do."""
    one = SimParams(chips=8, learners=8, mtbi_years=1 / 365, model_params=100_000_000, bandwidth_gbit=0.1, days=0.25)
    whole, fragments = simulate(one, "decoupled"), simulate(dataclasses.replace(one, fragments=8), "decoupled")
    assert whole.failures == fragments.failures >= 1
    assert fragments.details["fragments"] == 8 and fragments.rounds > 6 * whole.rounds  # a round per fragment
    assert fragments.details["live_share_merged"] >= 0.95 and fragments.details["forks"] == 0
    assert abs(fragments.goodput - whole.goodput) <= 0.01  # each fragment's merge holds a P-th of the work
    from p2pdiloco.sim.decoupled import DecoupledSim
    from p2pdiloco.sim.failures import draw
    eight = dataclasses.replace(one, fragments=8)
    assert DecoupledSim(eight, draw(eight)).lane_sizes.model_params == one.model_params // 8  # a P-th of the bytes
    with pytest.raises(ConfigError, match="cannot exceed H"):
        dataclasses.replace(one, fragments=200)
