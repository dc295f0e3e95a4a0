"""A SIGKILLed peer loses seconds, not rounds: with timed checkpoints it restarts from one written at most the
interval before the kill, with its round in flight or not, and over both of its lives no step is merged twice."""

import signal
import time

import pytest

from p2pdiloco.runtime.schema import Checkpoint, Contribute, Restore, Round, Window
from p2pdiloco.training import checkpoint
from tests.harness.swarm import local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(600)]
EVERY = 3.0
ARGS = ["-H", "10", "--max-time", "300", "--checkpoint-every", "0", "--checkpoint-seconds", str(EVERY)]


def merged_steps(records) -> int:
    """The steps of our contributions that islands merged: each contribution with the round that settled it."""
    total, pending = 0, None
    for r in records:
        if isinstance(r, Contribute):
            pending = r
        elif isinstance(r, Round) and pending is not None:
            if r.outcome in ("committed", "solo"):
                total += pending.steps
            pending = None
    return total


def test_a_peer_sigkilled_with_its_round_in_flight_loses_at_most_its_interval_and_merges_no_step_twice(tmp_path):
    with local_swarm(tmp_path, "kills") as swarm:
        swarm.start_peer("a", *ARGS)
        swarm.start_peer("b", *ARGS)
        swarm.wait_for(lambda: swarm.version("b") >= 2, 150, "a and b to merge twice")
        # kill b just after it contributed: its round is in flight, and a timed checkpoint may hold it
        count = len(swarm.records("b", "contribute"))
        swarm.wait_for(lambda: len(swarm.records("b", "contribute")) > count, 60, "b's next contribution")
        time.sleep(1.0)
        swarm.procs["b"].send_signal(signal.SIGKILL)
        killed = time.time()
        swarm.procs["b"].wait(30)
        first_life = swarm.records("b")
        saved = [r for r in first_life if isinstance(r, Checkpoint) and r.why == "timed"]
        assert saved, "no timed checkpoint was written"
        lost = killed - saved[-1].time
        step = [r.step_seconds for r in first_life if isinstance(r, Window)][-1]
        assert lost <= EVERY + max(step, saved[-1].seconds or 0.0) + 1.0, (lost, step)

        swarm.start_peer("b", *ARGS, via=swarm.address_of("a"))
        swarm.wait_for(lambda: swarm.records("b", "restore"), 60, "b to restore its checkpoint")
        restored = [r for r in swarm.records("b") if isinstance(r, Restore)][0]
        assert restored.path == saved[-1].path
        before = len(swarm.records("b", "round"))
        swarm.wait_for(lambda: any(r.applied and len(r.members) > 1 for r in swarm.records("b", "round")[before:]),
                       150, "b to merge again")
        for name in ("a", "b"):
            swarm.procs[name].send_signal(signal.SIGTERM)
        swarm.wait(["a", "b"], timeout=60)
        final = checkpoint.latest_meta(tmp_path / "checkpoints" / "kills" / "b")  # written on leaving
        assert merged_steps(swarm.records("b")) <= final["inner_step"]  # the lineage's steps, each merged once
