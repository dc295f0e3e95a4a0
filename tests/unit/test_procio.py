"""Measured traffic: the kernel's per-process I/O counters see what a process writes and reads."""

import subprocess
import sys
import time

from p2pdiloco.runtime.procio import io_counters, moved_since

ECHO = "import sys, time; data = sys.stdin.buffer.read(); sys.stdout.buffer.write(data * 3); sys.stdout.flush(); time.sleep(30)"


def test_the_bytes_a_process_writes_to_a_pipe_are_counted():
    child = subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        before = io_counters(child.pid)  # the interpreter may still be starting: it reads its own files
        child.stdin.write(b"y" * 1_000_000)
        child.stdin.close()
        assert len(child.stdout.read(3_000_000)) == 3_000_000
        moved = _once_the_write_returns(child.pid, before)
        assert 3_000_000 <= moved.written < 3_100_000
        assert 1_000_000 <= moved.read
    finally:
        child.kill()
        child.wait()


def _once_the_write_returns(pid, before, deadline_s=20.0):
    # The kernel adds to wchar when the write call returns, which can be after we have read its last byte:
    # on a loaded machine the child may not run again for a while (a CI run once saw 0 here).
    give_up = time.monotonic() + deadline_s
    while True:
        moved = moved_since(pid, before)
        if moved.written >= 3_000_000 or time.monotonic() > give_up:
            return moved
        time.sleep(0.05)


def test_a_process_that_is_gone_has_no_counters():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert io_counters(child.pid) is None and io_counters(None) is None
    assert moved_since(child.pid, None) is None
