"""How scripts/bench/sim_vs_chaos.py reads a chaos run's checkpoint cadence for the simulator's restart model."""

from p2pdiloco.ops.chaos import ChaosPlan
from p2pdiloco.runtime.schema import Checkpoint, Round, Start
from scripts.bench.sim_vs_chaos import checkpoint_gaps, restart_delay


def test_checkpoint_gaps_are_measured_within_one_life():
    """A kill and restart begins a new life: the gap across it is the kill's, not the peer's cadence."""
    life = [Start(time=0.0), Checkpoint(time=10.0), Round(time=11.0), Checkpoint(time=14.0), Checkpoint(time=20.0)]
    restarted = [Start(time=40.0), Checkpoint(time=50.0), Checkpoint(time=53.0)]
    assert checkpoint_gaps(life + restarted) == [4.0, 6.0, 3.0]
    assert checkpoint_gaps([Start(time=0.0), Checkpoint(time=5.0)]) == []


def test_only_the_chaos_tools_own_restarts_wait_a_killed_workers_supervisor_forks_at_once():
    plan = ChaosPlan(restart_after=(2.0, 10.0))
    assert restart_delay(dict(kills=8, peer_kills=8), plan) == 6.0  # a whole peer: the tool's mean wait
    assert restart_delay(dict(kills=8, peer_kills=0), plan) == 0.0  # its process: the supervisor's fork
    assert restart_delay(dict(kills=8, peer_kills=4), plan) == 3.0
