"""Measured traffic: the kernel's per-process I/O counters see what a process writes and reads."""

import subprocess
import sys

from p2pdiloco.runtime.procio import io_counters, moved_since

ECHO = "import sys, time; data = sys.stdin.buffer.read(); sys.stdout.buffer.write(data * 3); sys.stdout.flush(); time.sleep(30)"


def test_the_bytes_a_process_writes_to_a_pipe_are_counted():
    child = subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        before = io_counters(child.pid)  # the interpreter may still be starting: it reads its own files
        child.stdin.write(b"y" * 1_000_000)
        child.stdin.close()
        assert len(child.stdout.read(3_000_000)) == 3_000_000
        moved = moved_since(child.pid, before)
        assert 3_000_000 <= moved.written < 3_100_000
        assert 1_000_000 <= moved.read
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_has_no_counters():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert io_counters(child.pid) is None and io_counters(None) is None
    assert moved_since(child.pid, None) is None
