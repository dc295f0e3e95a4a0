"""A swarm started with a key: its peers merge; a peer with no key or the wrong one cannot join (it finds no
peer through the DHT), and the others go on unaffected; `status` needs the key too."""

import json
import subprocess
import sys
import time

import pytest

from p2pdiloco.ops.launcher import join_command, start_bootstrap, start_process, stop_tree
from p2pdiloco.runtime.schema import Round, of_kind, read_records
from tests.harness.swarm import TINY

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


# opt-in (the suite's 15 minutes): tests/unit/test_averager_seams.py refuses followers, members and state requests
# without a valid pass, and tests/unit/test_swarm_key.py checks the signatures
@pytest.mark.slow
def test_only_peers_with_the_swarm_key_can_join(tmp_path):
    key, wrong = tmp_path / "swarm.key", tmp_path / "wrong.key"
    key.write_text("0123456789abcdef0123456789abcdef\n")
    wrong.write_text("fedcba9876543210fedcba9876543210\n")
    procs = {}
    try:
        procs["bootstrap"], address = start_bootstrap(tmp_path, ["--swarm-key-file", str(key)])
        for name in ("a", "b"):
            procs[name] = start_process(join_command(address, name, tmp_path, *TINY, "-H", "10", "--max-rounds", "8",
                                                     "--eval-every", "0", "--swarm-key-file", str(key)),
                                        tmp_path / f"{name}.log")
        status = [sys.executable, "-m", "p2pdiloco.cli", "status", "--initial-peers", address, "--json",
                  "--connect-timeout", "8"]

        def names_seen() -> set:
            seen = subprocess.run([*status, "--swarm-key-file", str(key)], capture_output=True, text=True, timeout=60)
            assert seen.returncode == 0, seen.stderr[-2000:]
            return {p["name"] for p in json.loads(seen.stdout.splitlines()[-1])["peers"]}

        deadline = time.monotonic() + 90
        while names_seen() != {"a", "b"}:
            assert time.monotonic() < deadline, "status with the key never listed both peers"
        assert subprocess.run(status, capture_output=True, text=True, timeout=60).returncode == 1  # no key
        for name, args in (("nokey", []), ("wrongkey", ["--swarm-key-file", str(wrong)])):
            out = subprocess.run(join_command(address, name, tmp_path, *TINY, "--connect-timeout", "8", *args),
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 1, out.stderr[-2000:]
            assert "could not join the swarm" in out.stderr and "key" in out.stderr and "Traceback" not in out.stderr
        for name in ("a", "b"):
            assert procs[name].wait(180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            stop_tree(proc)
    rounds = of_kind(read_records(tmp_path / "a.jsonl"), Round)
    assert any(r.applied and sorted(r.members) == ["a", "b"] for r in rounds), rounds
