"""A peer that starts again by itself, in about a second, after it crashes.

A restarted peer used to spend most of its restart importing torch, transformers and hivemind again (16.4 s of a
median 19.6 s in a chaos run on 2 shared cores, 4.9 s of 5.7 s alone: docs/simulator.md). Here the command's
process becomes a supervisor: it imports that code once, then forks the peer from itself, and forks a new one
the moment the old one dies. The child returns from `Supervisor.fork_lives` and runs exactly the code an
unsupervised peer runs, so it exits the way one does; it resumes from its own checkpoint, as any restart does.

What is restarted: a peer that died by a signal (SIGKILL, the kernel's out-of-memory killer, a segfault) or of an
unhandled error (EXIT_CRASH). What is not: a clean exit, one of the one-line errors that need the user (exit 1:
bad data, no peer reachable, a disk that cannot take a checkpoint), a stop the user asked for. A life that died
before it reached its first inner step is a failed start: those back off (at once, then 1, 2, 4 … 60 s), and
`failed_starts` of them in a row end the supervisor, so a peer that cannot start does not spin.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from p2pdiloco.runtime.stopwatch import process_started

log = logging.getLogger("p2pdiloco")

EXIT_CRASH = 70  # sysexits' EX_SOFTWARE: an unhandled error, worth a restart
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Death:
    """How one life of the peer ended."""
    code: Optional[int]  # its exit code, or None when a signal ended it
    signal: Optional[int]
    trained: bool  # it reached its first inner step
    asked_to_stop: bool  # the supervisor had passed a stop signal on to it

    @property
    def crashed(self) -> bool:
        return self.signal is not None or self.code == EXIT_CRASH

    @property
    def exit_code(self) -> int:
        """What the supervisor exits with when this life is the last: the shell's convention for a signal."""
        return 128 + self.signal if self.signal is not None else int(self.code or 0)

    def describe(self) -> str:
        if self.signal is not None:
            return f"was killed by {signal.Signals(self.signal).name}"
        return f"exited with code {self.code}"


@dataclass(frozen=True)
class RestartRule:
    failed_starts: int = 5  # failed starts in a row (lives that never trained) that end the supervisor
    backoff_cap: float = 60.0

    def delay(self, death: Death, failed_in_a_row: int) -> Optional[float]:
        """Seconds to wait before the next life, or None: no next life. `failed_in_a_row` counts this death."""
        if death.asked_to_stop or not death.crashed or failed_in_a_row >= self.failed_starts:
            return None
        if failed_in_a_row <= 1:  # it trained, or this is the first failed start: at once
            return 0.0
        return min(self.backoff_cap, 2.0 ** (failed_in_a_row - 2))


class Supervisor:
    """Forks lives of the peer and waits on them; only stop signals and deaths drive it."""

    def __init__(self, rule: RestartRule, sleep: Callable[[float], None] = time.sleep):
        """Build it before the imports its lives need: from here on its pages are shared with them."""
        gc.disable()  # Python's advice for a process that forks without exec: no freed holes in shared pages
        self.began = time.monotonic()
        self.started = process_started()  # the first life's start-up counts our imports too
        self.rule, self.sleep = rule, sleep
        self.pid = os.getpid()
        self.child: Optional[int] = None
        self.stopping = False
        self.lives = 0

    def fork_lives(self, preload: Callable[[], None] = lambda: None) -> "Life":
        """Runs `preload` (the imports every life needs), then returns in each child, as its `Life`; in the
        supervisor, exits when no life follows."""
        preload()
        log.info(f"supervisor: the peer's code imported in {time.monotonic() - self.began:.1f} s; its lives fork "
                 "from here")
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        failed = 0
        while not self.stopping:
            ready_r, ready_w = os.pipe()
            self.lives += 1
            gc.freeze()  # a life's collections then never write to the objects it shares with us
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                return Life(self.pid, ready_w, self.lives, self.started if self.lives == 1 else None)
            self.child = pid
            if self.stopping:  # a stop signal came between the fork and the line above: it was not passed on
                os.kill(pid, signal.SIGTERM)
            os.close(ready_w)
            death = self._wait(pid, ready_r)
            failed = 0 if death.trained else failed + 1
            delay = self.rule.delay(death, failed)
            if delay is None:
                self._exit(death, failed)
            log.warning(f"supervisor: the peer {death.describe()}; life {self.lives + 1} starts"
                        + (f" in {delay:.0f} s ({failed} failed starts in a row)" if delay else " now"))
            self._pause(delay)
        _exit_now(0)  # asked to stop between two lives: nothing ran, nothing to save

    def _wait(self, pid: int, ready_r: int) -> Death:
        _, status = os.waitpid(pid, 0)  # a stop signal runs _forward and the wait resumes (PEP 475)
        self.child = None
        trained = _has_byte(ready_r)
        os.close(ready_r)
        if os.WIFSIGNALED(status):
            return Death(None, os.WTERMSIG(status), trained, self.stopping)
        return Death(os.WEXITSTATUS(status), None, trained, self.stopping)

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self.sleep(min(left, 0.5))

    def _exit(self, death: Death, failed: int) -> None:
        if death.crashed and not death.asked_to_stop:
            log.error(f"supervisor: the peer {death.describe()} after {failed} failed starts in a row; giving up")
        _exit_now(death.exit_code)

    def _forward(self, signum, _frame) -> None:
        if os.getpid() != self.pid:  # a life between its fork and its own handlers: the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum != signal.SIGUSR1:  # SIGUSR1 asks the peer for its threads' stacks, not to stop
            self.stopping = True
        if self.child is not None:
            try:
                os.kill(self.child, signum)
            except ProcessLookupError:
                pass


class Life:
    """One life of a supervised peer, in the child: it tells the supervisor once it reaches its first inner step."""

    def __init__(self, supervisor: int, ready_fd: int, number: int, began: Optional[float]):
        self.number, self._ready = number, ready_fd
        self.began = began  # when its start-up began, if before its fork (the first life: the supervisor's start)
        gc.enable()
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor alone, which passes it on once
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        _die_with(supervisor)

    def trained(self) -> None:
        if self._ready is not None:
            os.write(self._ready, b"1")
            os.close(self._ready)
            self._ready = None


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: it has nothing of ours to close (its lives did that), and tearing
    down torch, transformers and hivemind took 0.6 s, which every launcher that stops a peer waited for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _has_byte(fd: int) -> bool:
    """Whether the life wrote its byte. Never waits: the helpers it forked hold the pipe's other end a while."""
    os.set_blocking(fd, False)
    try:
        return len(os.read(fd, 1)) > 0
    except BlockingIOError:
        return False


def _die_with(parent: int) -> None:
    """A supervisor that is SIGKILLed takes its peer along (the peer's lifeline then takes the helpers)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
        os._exit(1)  # no death signal on this system, or the supervisor is already gone


def supported() -> bool:
    """Fork and the parent-death signal: Linux."""
    return sys.platform.startswith("linux")
