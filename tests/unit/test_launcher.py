import signal
import subprocess
import sys
import time

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
        from p2pdiloco.lifeline import descendants

        tree = descendants(launcher.pid)
        assert len(tree) >= 4  # bootstrap and peer, with their helpers
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(60)
        time.sleep(1)
        assert [pid for pid in tree if alive(pid)] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
