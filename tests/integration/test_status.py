"""`p2pdiloco status` against a live local swarm: it lists every peer with sane values and drops a SIGKILLed one
once its record expires."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from p2pdiloco.swarm.records import TTL
from tests.harness.swarm import local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]


def status(swarm) -> dict:
    out = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "status", "--initial-peers", swarm.address,
                          "--run-id", swarm.run_id, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_status_lists_the_live_peers_and_drops_a_killed_one(tmp_path):
    names = ["a", "b", "c"]
    with local_swarm(tmp_path, "status") as swarm:
        for name in names:
            swarm.start_peer(name, "-H", "10", "--max-rounds", "200", "--eval-every", "0")
        swarm.wait_for(lambda: all(swarm.records(n, "round") for n in names), 240, "a round on every peer")
        swarm.wait_for(lambda: (lambda v: v["n_peers"] == 3 and all(p["rounds"] for p in v["peers"]))(status(swarm)),
                       60, "every peer's record to show its rounds")
        view = status(swarm)
        assert sorted(p["name"] for p in view["peers"]) == names
        for p in view["peers"]:
            assert p["tokens_per_s"] > 0 and 0 < p["loss"] < 6.0, p  # byte-level loss starts at ln 256 ≈ 5.5
            assert p["version"] >= 0 and p["rounds"] >= 1 and 1 <= p["island"] <= 3 and not p["client_mode"], p
            assert 0 <= p["seen_seconds_ago"] <= TTL, p
        assert view["tokens_per_s"] == pytest.approx(sum(p["tokens_per_s"] for p in view["peers"]))
        assert any(p["bytes_sent"] > 0 for p in view["peers"]), view  # someone merged with someone
        os.kill(swarm.procs["c"].pid, signal.SIGKILL)  # no goodbye: its record must expire by itself
        killed = time.monotonic()
        swarm.wait_for(lambda: sorted(p["name"] for p in status(swarm)["peers"]) == ["a", "b"], TTL + 30,
                       "the killed peer's record to expire")
        assert time.monotonic() - killed <= TTL + 30
