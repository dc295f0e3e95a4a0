import signal
import subprocess
import sys
import time

import pytest

from tests.harness.swarm import alive


def test_sigterm_to_the_launcher_stops_every_process_it_started(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", "swarm", "--peers", "1", "--log-dir",
                                 str(tmp_path), "--model", "tiny", "--threads", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "peer0.addrs").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (tmp_path / "peer0.addrs").exists()
        from p2pdiloco.runtime.lifeline import descendants

        tree = descendants(launcher.pid)
        assert len(tree) >= 4  # bootstrap and peer, with their helpers
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(60)
        time.sleep(1)
        assert [pid for pid in tree if alive(pid)] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_stop_tree_does_not_signal_twice_a_process_already_asked_to_leave(tmp_path):
    """A second SIGTERM makes a peer leave at once (no checkpoint, no summary): callers that already sent
    one must be able to wait for the graceful exit instead."""
    import signal
    import subprocess
    import sys

    from p2pdiloco.ops.launcher import stop_tree

    script = (
        "import signal, sys, time\n"
        "seen = []\n"
        "def on_term(*_):\n"
        "    seen.append(1)\n"
        "    open(sys.argv[1] + '.seen', 'w').write('1')\n"
        "    if len(seen) > 1:\n"
        "        open(sys.argv[1], 'w').write('abrupt'); sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "open(sys.argv[1] + '.ready', 'w').write('1')\n"
        "while not seen: time.sleep(0.01)\n"
        "time.sleep(0.5)\n"
        "open(sys.argv[1], 'w').write('graceful')\n"
    )
    for flag, expected in ((True, "graceful"), (False, "abrupt")):
        out = tmp_path / f"out-{flag}"
        proc = subprocess.Popen([sys.executable, "-c", script, str(out)])
        while not (tmp_path / f"out-{flag}.ready").exists():
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        while not (tmp_path / f"out-{flag}.seen").exists():  # two signals at once would merge into one
            time.sleep(0.01)
        stop_tree(proc, grace=10, already_signalled=flag)
        assert out.read_text() == expected


def test_the_testbed_refuses_to_run_without_root_and_says_so(monkeypatch):
    from p2pdiloco.ops.testbed import Testbed, TestbedError

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="needs root"):
        Testbed(2).start()


def test_nproc_becomes_torchrun_over_the_same_command_without_it():
    from p2pdiloco.ops.launcher import ranks_command, without_option

    args = ["join", "--nproc", "4", "--model", "tiny", "--nproc=3", "--name", "box"]
    assert without_option(args, "--nproc") == ["join", "--model", "tiny", "--name", "box"]
    assert ranks_command(4, ["join", "--name", "box"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
        "p2pdiloco.cli", "join", "--name", "box"]
