"""The supervisor restarts a crashed peer at once, forked from itself, and stops when a restart cannot help.

Each case runs a supervisor in its own small process (no torch) whose lives follow a script: life n does what
the n-th word says. The lives append to a journal, so the test reads what happened in which order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from p2pdiloco.runtime.supervise import EXIT_CRASH, Death, RestartRule

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl: Linux")

LIVES = textwrap.dedent("""
    import os, signal, sys, time
    from p2pdiloco.runtime.supervise import RestartRule, Supervisor
    script, journal = sys.argv[1].split(","), sys.argv[2]
    life = Supervisor(RestartRule(failed_starts=3)).fork_lives()
    act = script[min(life.number, len(script)) - 1]
    with open(journal, "a") as f:
        f.write(f"{life.number} {os.getpid()} {os.getppid()} {time.time()}\\n")
    if act.startswith("train"):
        life.trained()
        act = act[len("train-"):]
    if act == "helper-kill":  # a forked helper outlives it a while, holding what it inherited
        if os.fork() == 0:
            time.sleep(8)
            os._exit(0)
        act = "kill"
    if act == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if act == "crash":
        os._exit(70)
    if act == "wait":  # until a stop signal: a graceful leave
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        time.sleep(60)
    sys.exit(int(act or 0))
""")


def supervise(script: str, tmp_path, wait: bool = True):
    journal = tmp_path / "journal"
    journal.touch()
    proc = subprocess.Popen([sys.executable, "-c", LIVES, script, str(journal)], stderr=subprocess.PIPE, text=True)
    if wait:
        proc.wait(30)
    return proc, journal


def lives(journal) -> list[list[str]]:
    return [line.split() for line in journal.read_text().splitlines()]


def test_a_killed_or_crashed_life_is_followed_at_once_by_a_fork_of_the_supervisor(tmp_path):
    proc, journal = supervise("train-kill,train-crash,train-kill,0", tmp_path)
    seen = lives(journal)
    assert [int(n) for n, *_ in seen] == [1, 2, 3, 4] and proc.returncode == 0
    assert {parent for _, _, parent, _ in seen} == {str(proc.pid)}  # every life is the supervisor's child
    gaps = [float(b[3]) - float(a[3]) for a, b in zip(seen, seen[1:])]
    assert max(gaps) < 2.0  # no backoff after a life that trained; no imports either
    assert "was killed by SIGKILL; life 2 starts now" in proc.stderr.read()


@pytest.mark.parametrize("script, code", [("0", 0), ("1", 1), ("130", 130), ("train-2", 2)])
def test_an_exit_that_a_restart_cannot_help_ends_the_supervisor_with_its_code(tmp_path, script, code):
    proc, journal = supervise(script, tmp_path)
    assert len(lives(journal)) == 1 and proc.returncode == code


def test_a_life_whose_helper_outlives_it_is_followed_without_waiting_for_the_helper(tmp_path):
    proc, journal = supervise("helper-kill,0", tmp_path)
    (_, _, _, first), (_, _, _, second) = lives(journal)
    assert proc.returncode == 0 and float(second) - float(first) < 4.0


def test_failed_starts_back_off_and_end_it(tmp_path):
    proc, journal = supervise("kill", tmp_path)  # never trains: 3 failed starts allowed
    seen = lives(journal)
    assert len(seen) == 3 and proc.returncode == 128 + signal.SIGKILL
    assert float(seen[2][3]) - float(seen[1][3]) >= 1.0  # the second failed start in a row waits 1 s
    assert "after 3 failed starts in a row; giving up" in proc.stderr.read()


def test_a_stop_signal_reaches_the_life_once_and_nothing_restarts(tmp_path):
    proc, journal = supervise("wait", tmp_path, wait=False)
    deadline = time.time() + 20
    while not lives(journal) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0 and len(lives(journal)) == 1


def test_a_killed_supervisor_takes_its_life_along(tmp_path):
    proc, journal = supervise("wait", tmp_path, wait=False)
    deadline = time.time() + 20
    while not lives(journal) and time.time() < deadline:
        time.sleep(0.05)
    child = int(lives(journal)[0][1])
    proc.kill()
    proc.wait(10)
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return stat[0] != "Z"


@pytest.mark.parametrize("death, failed, delay", [
    (Death(None, signal.SIGKILL, True, False), 0, 0.0),
    (Death(EXIT_CRASH, None, True, False), 0, 0.0),
    (Death(None, signal.SIGKILL, False, False), 1, 0.0),
    (Death(None, signal.SIGKILL, False, False), 2, 1.0),
    (Death(None, signal.SIGKILL, False, False), 4, 4.0),
    (Death(None, signal.SIGKILL, False, False), 5, None),  # the fifth failed start in a row: give up
    (Death(None, signal.SIGTERM, True, True), 0, None),  # a stop the supervisor passed on
    (Death(0, None, True, False), 0, None),
    (Death(1, None, True, False), 0, None),  # a one-line error that needs the user
])
def test_the_restart_rule(death, failed, delay):
    assert RestartRule(failed_starts=5).delay(death, failed) == delay


def test_the_backoff_is_capped():
    assert RestartRule(failed_starts=50, backoff_cap=60).delay(Death(None, 9, False, False), 20) == 60


def test_the_supervisor_preloads_the_models_transformers_classes_which_load_lazily():
    """What the lives share: without it every restart imported the Llama classes again (2.4 s alone on this VM)."""
    probe = textwrap.dedent("""
        import sys
        from p2pdiloco.training.model import import_model_code
        llama = "transformers.models.llama.modeling_llama"
        before = llama in sys.modules
        import_model_code("no/such/model")  # neither a preset nor a path: left to the peer, no error
        import_model_code("tiny")
        print(before, llama in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
