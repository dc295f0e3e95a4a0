"""The chaos/benchmark figures, computed by hand on small synthetic logs."""

import pytest

from p2pdiloco.ops.swarmreport import (val_by_version, val_rises, advances, goodput, islands_disagreeing, longest_stalls, split_lives,
                                   model_tokens, running, startup_phases, unresolved_forks, uptime, Life)
from p2pdiloco.runtime.schema import from_dict


def rec(kind, t, **fields):
    return from_dict(dict(kind=kind, time=t, **fields))


def window(t, compute, merged, step_seconds=1.0):
    return rec("window", t, compute_seconds=compute, merged_seconds=merged, step_seconds=step_seconds)


def round_(t, version, applied=True, group="g", digest="d", adopted=False, fork=0.0, n=0, forked_with=()):
    return rec("round", t, version=version, applied=applied, group_id=group, digest=digest, adopted=adopted,
               fork_distance=fork, round=n, forked_with=list(forked_with))


def test_lives_are_cut_at_spawns_and_end_at_a_kill_or_the_run_end():
    records = [rec("start", 5), window(20, 10, 8), rec("start", 65), window(90, 20, 15)]
    first, second = split_lives("a", records, spawns=[0, 60], deaths=[50, None], end=100)
    assert (first.spawned, first.ended, len(first.records)) == (0, 50, 2)
    assert (second.spawned, second.ended, len(second.records)) == (60, 100, 2)
    assert first.training_from == 5 and second.training_from == 65


def test_goodput_counts_dead_time_as_allocated_and_only_merged_step_time_as_useful():
    a = split_lives("a", [rec("start", 5), window(45, 40, 30), rec("start", 65), window(95, 33, 30)],
                    spawns=[0, 60], deaths=[50, None], end=100)
    b = split_lives("b", [rec("start", 3), window(95, 95, 90)], spawns=[0], deaths=[None], end=100,
                    frozen=[(20, 30)])
    g = goodput(a + b, start=0, end=100)
    assert g["allocated_seconds"] == 200  # both slots from their first spawn to the end, deaths included
    assert g["merged_seconds"] == 150 and g["goodput"] == pytest.approx(0.75)
    assert g["alive_seconds"] == 50 + 40 + 90  # b's 10 frozen seconds are not alive time
    assert g["utilization"] == pytest.approx((40 + 33 + 95) / 180)


def test_uptime_is_the_share_of_windows_in_which_the_global_model_advanced():
    lives = split_lives("a", [round_(t, v) for t, v in [(5, 1), (15, 2), (16, 2), (25, 3), (65, 4), (75, 5)]]
                        + [round_(80, 5, applied=False)], spawns=[0], deaths=[None], end=100)
    times = advances(lives)
    assert times == [5, 15, 25, 65, 75]  # a second merge at one version is no advance
    assert uptime(times, start=0, end=100, window=10) == pytest.approx(0.5)


def test_the_models_tokens_are_the_most_any_applied_round_merged_into_its_state():
    rounds = [rec("round", 1, version=1, applied=True, swarm_tokens=100),
              rec("round", 2, version=2, applied=True, swarm_tokens=250),
              rec("round", 3, version=3, applied=False, swarm_tokens=900),  # rolled back: never in Θ
              rec("round", 4, version=2, applied=True, swarm_tokens=None)]
    assert model_tokens(rounds) == 250 and model_tokens([]) == 0


def test_stalls_exclude_frozen_time_and_count_time_without_a_merge():
    records = [rec("start", 0), window(10, 10, 0), window(40, 20, 0), round_(41, 1), window(50, 30, 10),
               round_(90, 2)]
    lives = split_lives("a", records, spawns=[0], deaths=[None], end=100, frozen=[(15, 30)])
    stalls = longest_stalls(lives, step_window=10)
    # 10→40 is 30 s for 10 one-second steps, 15 of them frozen: a 5 s stall
    assert stalls["longest_stall_seconds"] == pytest.approx(5.0)
    assert stalls["longest_without_merge_seconds"] == pytest.approx(49.0)  # 41 → 90


def test_an_island_whose_members_disagree_is_flagged_but_two_islands_forking_is_not():
    fork = [round_(1, 3, group="g1", digest="x"), round_(1, 3, group="g1", digest="x"),
            round_(1, 3, group="g2", digest="y")]
    assert islands_disagreeing(fork) == {}
    mixed = fork + [round_(2, 4, group="g3", digest="p"), round_(2, 4, group="g3", digest="q")]
    assert islands_disagreeing(mixed) == {"g3": {(4, "p"), (4, "q")}}
    stale = fork + [round_(2, 5, group="g1", digest="z", adopted=True)]  # downloaded something newer
    assert islands_disagreeing(stale) == {}


def test_a_fork_that_outlives_its_bound_is_reported():
    resolved = [round_(t, t, fork=f, n=t) for t, f in enumerate([0, 2.0, 2.0, 0, 0, 0])]
    stuck = [round_(t, t, fork=f, n=t) for t, f in enumerate([0, 2.0, 2.0, 2.0, 0, 0])]
    assert unresolved_forks({"a": resolved}, within_rounds=2) == []
    assert unresolved_forks({"a": stuck}, within_rounds=2) == [("a", 1)]
    assert unresolved_forks({"a": stuck}, within_rounds=2, from_version=2) == []


def test_a_fork_only_with_peers_that_were_not_running_is_no_fork_of_live_peers():
    # b was killed at 2.5 and restarted at 3.5; c was frozen from 0.5 to 1.5; a fork with either counts only
    # while it ran
    lives = [Life("b", 0.0, 2.5, []), Life("b", 3.5, 10.0, []), Life("c", 0.0, 10.0, [], frozen=[(0.5, 1.5)])]
    live = running(lives)
    assert [live("b", t) for t in (1.0, 3.0, 4.0)] == [True, False, True]
    assert [live("c", t) for t in (1.0, 2.0)] == [False, True] and not live("nobody", 1.0)

    def forked_with(name):  # rounds at 0..5, forked from 1 on
        return [round_(t, t, fork=2.0 if t else 0.0, n=t, forked_with=[name] if name else []) for t in range(6)]
    everything = [("a", 1), ("a", 2), ("a", 3)]
    assert unresolved_forks({"a": forked_with("b")}, within_rounds=2) == everything
    assert unresolved_forks({"a": forked_with("b")}, within_rounds=2, live=live) == []  # b was dead at 3
    assert unresolved_forks({"a": forked_with("c")}, within_rounds=2, live=live) == [("a", 2), ("a", 3)]  # c: 2-5
    assert unresolved_forks({"a": forked_with(None)}, within_rounds=2, live=live) == everything  # names nobody


def test_the_merged_models_loss_by_version_and_the_rounds_that_raised_it():
    from p2pdiloco.runtime.schema import Round
    a = [Round(version=1, applied=True, val_loss=5.0), Round(version=2, applied=True, val_loss=4.5),
         Round(version=3, applied=False, val_loss=9.0),  # not merged: not the global model's
         Round(version=3, applied=True, val_loss=4.6, digest="x")]
    b = [Round(version=3, applied=True, val_loss=4.55, digest="y"),  # a fork at v3: its better state counts
         Round(version=4, applied=True, val_loss=None), Round(version=5, applied=True, val_loss=4.4)]
    val = val_by_version([a, b])
    assert val == {1: 5.0, 2: 4.5, 3: 4.55, 5: 4.4}
    assert val_rises(val) == [(3, 4.5, 4.55)]
    assert val_rises(val, noise=0.05) == [] and val_rises({1: 2.0, 2: 2.0}) == []  # equal is not a rise


def test_the_demos_check_fails_naming_the_round_that_raised_the_loss(tmp_path, capsys):
    from p2pdiloco.ops.swarmreport import main
    from p2pdiloco.runtime.metrics import JsonlSink
    from p2pdiloco.runtime.schema import Round
    for name, losses in {"peer0": [5.0, 4.0, 4.2], "peer1": [5.0, 4.0, 4.2]}.items():
        sink = JsonlSink(tmp_path / "rose" / f"{name}.jsonl")
        for version, loss in enumerate(losses, 1):
            sink.write(Round(peer=name, version=version, applied=True, val_loss=loss))
        sink.close()
        sink = JsonlSink(tmp_path / "fell" / f"{name}.jsonl")
        for version, loss in enumerate(sorted(losses, reverse=True), 1):
            sink.write(Round(peer=name, version=version, applied=True, val_loss=loss))
        sink.close()
    assert main(["--falling", str(tmp_path / "fell")]) == 0
    assert main(["--falling", str(tmp_path / "rose")]) == 1
    assert "round to v3 raised the merged model's validation loss: 4.0000 -> 4.2000" in capsys.readouterr().err
    assert main(["--falling", str(tmp_path / "nothing")]) == 1


def test_a_restarts_seconds_are_the_median_of_the_lives_that_resumed_from_their_own_checkpoint():
    cold = dict(imports=3.0, workload=6.0, join=9.0)
    lives = split_lives("a", [rec("start", 18, startup=cold),
                              rec("restore", 70), rec("start", 71, startup=dict(imports=2.0, workload=5.0, join=0.5)),
                              rec("restore", 130), rec("start", 131, startup=dict(imports=4.0, workload=6.0, join=0.1))],
                        spawns=[0, 60, 120], deaths=[50, 110, None], end=200)
    phases = startup_phases(lives)  # the first life joined cold: not a restart
    assert phases["restart_phases_median"] == dict(imports=3.0, workload=5.5, join=0.3)
    assert phases["restart_seconds_median"] == pytest.approx((7.5 + 10.1) / 2)
    assert startup_phases(lives[:1]) == dict(restart_phases_median={}, restart_seconds_median=None)
