"""The lifeline takes a dead peer's helpers down with it, even when they were reparented before it looked."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from p2pdiloco.runtime import lifeline
from p2pdiloco.runtime.lifeline import _stat, descendants, refresh
from tests.harness.swarm import alive


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_helper_missing_from_a_later_scan_is_still_taken_down_but_a_dead_one_is_dropped():
    helper, gone = sleeper(), sleeper()
    try:
        seen = {p.pid: _stat(p.pid)[1] for p in (helper, gone)}
        snapshot = refresh({}, seen)
        gone.kill()
        gone.wait()
        # the peer died mid-scan: its children were already reparented to init, so the scan found nothing
        snapshot = refresh(snapshot, {})
        assert snapshot == {helper.pid: seen[helper.pid]}
        # a reused pid (another start time) is never mistaken for the helper
        assert refresh({helper.pid: seen[helper.pid] + 1}, {}) == {}
    finally:
        helper.kill()
        helper.wait()


PEER = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
from p2pdiloco.runtime.lifeline import start_lifeline
start_lifeline()
print(helper.pid, flush=True)
time.sleep(60)
"""


def sigkill_and_see_its_tree_go(script: str, why: str) -> None:
    """Run `script` (it prints its helper's pid, its watchdog beside it), SIGKILL it once the watchdog has
    looked, and see the helper and the watchdog gone within 5 s."""
    peer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(peer.stdout.readline())
        deadline = time.monotonic() + 10
        while len(descendants(peer.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = descendants(peer.pid)
        assert helper in tree and len(tree) == 2, tree  # the helper and the watchdog
        time.sleep(1.0)  # the watchdog's first snapshot (its imports, then one look)
        peer.send_signal(signal.SIGKILL)
        peer.wait()
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in tree if alive(pid)], why
    finally:
        for pid in descendants(peer.pid):
            os.kill(pid, signal.SIGKILL)
        peer.kill()


def test_helpers_of_a_sigkilled_process_die_within_a_second():
    sigkill_and_see_its_tree_go(PEER, "the helper (or the lifeline) outlived its peer")


THREADED_PEER = """
import os, subprocess, sys, threading, time
found = []
def spawn():  # a helper forked by a thread that then ends, as hivemind's DHT is started from one
    found.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid)
worker = threading.Thread(target=spawn)
worker.start()
worker.join()
# the watchdog, with a period far longer than the test waits: only the pidfd can wake it in time
subprocess.Popen([sys.executable, "-c", "import os; from p2pdiloco.runtime.lifeline import watch; "
                  "watch(os.getppid(), period=60)"], start_new_session=True)
print(found[0], flush=True)
time.sleep(60)
"""


def test_the_watchdog_finds_a_helper_whose_forking_thread_ended_and_wakes_when_its_peer_dies():
    sigkill_and_see_its_tree_go(THREADED_PEER, "the watchdog slept through its peer's death")


@pytest.mark.skipif(not lifeline.CHILDREN_FILES, reason="this kernel lists no thread's children: the full scan")
def test_a_scan_reads_the_peers_tree_not_every_process_on_the_machine(monkeypatch):
    """Scanning all of /proc four times a second cost each peer 5.8 % of a core beside 520 processes."""
    # 40 processes that are not ours: their shell exits at once, and they pass to init. They must not hold the
    # pipe that subprocess.run reads to its end, or it waits out their 30 s.
    spawn = "for i in $(seq 40); do sleep 30 >/dev/null 2>&1 & echo $!; done"
    strangers = [int(pid) for pid in subprocess.run(["sh", "-c", spawn], capture_output=True, text=True,
                                                    check=True).stdout.split()]
    helper = sleeper()
    read = []
    real_stat = lifeline._stat
    monkeypatch.setattr(lifeline, "_stat", lambda pid: read.append(pid) or real_stat(pid))
    try:
        assert len(strangers) == 40 and helper.pid in lifeline.descendants(os.getpid())
        assert len(read) < 10, f"{len(read)} processes read for a tree of {len(lifeline.descendants(os.getpid()))}"
    finally:
        helper.kill()
        helper.wait()
        for pid in strangers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_peers_shared_tensors_are_unlinked_not_leaked_into_ram():
    """torch shares tensors through /dev/shm/torch_<pid>_* files (hivemind's averaged buffer); SIGKILL the
    process and its torch_shm_manager together, as the lifeline does, and the files stay behind in RAM-backed
    tmpfs: remove_shared_memory unlinks them."""
    import subprocess
    import sys
    from pathlib import Path

    from p2pdiloco.runtime.lifeline import descendants, kill_snapshot, remove_shared_memory

    code = ("import torch, torch.multiprocessing as mp, time; mp.set_sharing_strategy('file_system');"
            "t = torch.zeros(1 << 16).share_memory_(); print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        files = list(Path("/dev/shm").glob(f"torch_{proc.pid}_*"))
        assert files, "torch did not share through /dev/shm here"
        tree = {**descendants(proc.pid), proc.pid: 0}
        kill_snapshot({pid: start for pid, start in descendants(proc.pid).items()})
        proc.kill()
        proc.wait(10)
        time.sleep(0.3)
        assert any(f.exists() for f in files)  # the leak: nobody left to unlink them
        assert remove_shared_memory(tree) >= 1
        assert not any(f.exists() for f in files)
    finally:
        proc.kill()


SHARE_AND_REPORT = """
import os, sys, time, torch
import p2pdiloco.swarm  # chooses the sharing strategy for every swarm module
t = torch.zeros(1 << 16).share_memory_()
time.sleep(0.3)  # torch starts its manager, where the strategy has one, as it shares
from pathlib import Path
files = list(Path('/dev/shm').glob(f'torch_{os.getpid()}_*'))
children = [p for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/stat').read().split(') ')[1].split()[1] == str(os.getpid())]
names = [open(f'/proc/{p}/comm').read().strip() for p in children]
print(len(files), 'torch_shm_manag' in names, flush=True)
"""


@pytest.mark.parametrize("override", [None, "file_system"])
def test_a_peers_shared_tensors_leave_nothing_to_leak_and_need_no_manager(override):
    """Under file_descriptor, which the swarm package sets, a shared tensor's /dev/shm segment is unlinked as
    soon as it is mapped, so a SIGKILL can leak nothing, and no torch_shm_manager process runs beside
    the peer. hivemind's own variable still chooses: file_system brings both back."""
    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    if override:
        env["HIVEMIND_MEMORY_SHARING_STRATEGY"] = override
    out = subprocess.run([sys.executable, "-c", SHARE_AND_REPORT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    files, manager = out.stdout.split()
    if override:
        assert int(files) >= 1 and manager == "True", out.stdout
    else:
        assert int(files) == 0 and manager == "False", out.stdout


def test_children_are_a_processs_own_not_its_grandchildren():
    from p2pdiloco.runtime.lifeline import children

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                               "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "up"
        assert parent.pid in children(os.getpid())
        grandchildren = children(parent.pid)
        assert len(grandchildren) == 1 and grandchildren[0] not in children(os.getpid())
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
