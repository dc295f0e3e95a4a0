"""`join --nice`: the training process's threads, all of them, at the niceness asked; the helpers untouched."""

import json
import subprocess
import sys

import pytest

from p2pdiloco.config import ConfigError, PeerConfig

# A process with torch's worker threads and a Python thread started before the call, one started after, and a
# child forked before (as the helpers are): each one's niceness, read back from /proc (field 19 of stat).
SCRIPT = """
import json, os, sys, threading, time, torch
from p2pdiloco.runtime.priority import train_at_niceness

def niceness(path):
    return int(open(path).read().rsplit(')', 1)[1].split()[16])

torch.set_num_threads(2)
torch.randn(512, 512) @ torch.randn(512, 512)  # starts torch's worker threads
hold = threading.Event()
before = threading.Thread(target=hold.wait); before.start()
helper = os.fork()
if helper == 0:
    time.sleep(30); os._exit(0)
train_at_niceness(int(sys.argv[1]))
after = threading.Thread(target=hold.wait); after.start()
threads = [niceness(f"/proc/self/task/{tid}/stat") for tid in os.listdir("/proc/self/task")]
print(json.dumps(dict(threads=len(threads), nices=sorted(set(threads)), helper=niceness(f"/proc/{helper}/stat"))))
os.kill(helper, 9); hold.set()
"""


def niceness_after(nice: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(nice)], capture_output=True, text=True, check=True,
                         timeout=120)
    return json.loads(out.stdout)


def test_every_thread_trains_at_the_niceness_asked_and_a_forked_helper_keeps_its_own():
    seen = niceness_after(7)
    assert seen["threads"] >= 4, seen  # main, torch's worker, the two Python threads
    assert seen["nices"] == [7] and seen["helper"] == 0, seen


def test_nice_zero_changes_nothing_and_bad_values_are_refused():
    assert niceness_after(0)["nices"] == [0]
    for bad in (-1, 20, 2.5):
        with pytest.raises(ConfigError, match="nice must be an integer from 0 to 19"):
            PeerConfig(nice=bad)


def test_a_peer_lowers_its_priority_after_its_start_up_and_before_its_first_step(monkeypatch):
    """The start-up (imports, helpers, checkpoint) at the priority the peer was started with; then the steps."""
    from p2pdiloco import peer as peer_module

    calls = []

    class Stay:
        def train(self):
            calls.append("train")
            return {}

        def close(self):
            calls.append("close")

    monkeypatch.setattr(peer_module, "start", lambda cfg, stop, since: calls.append("start") or Stay())
    monkeypatch.setattr(peer_module, "train_at_niceness", lambda nice: calls.append(f"nice {nice}"))
    peer_module.Peer(PeerConfig(nice=5)).run()
    assert calls == ["start", "nice 5", "train", "close"]
