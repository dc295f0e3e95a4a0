"""Stop signals: the process that installed them takes them; a helper it forks (hivemind's DHT and averager
processes) still dies of the SIGTERM that hivemind sends a helper whose shutdown overran."""

import multiprocessing
import os
import signal
import threading
import time

from p2pdiloco.runtime.signals import on_stop_signals


def _idle():
    deadline = time.monotonic() + 30  # bounded: the test fails on its join, not by waiting forever
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _forked_from_a_thread(out: list):
    """As hivemind starts its DHT from our helper thread: a fork of this process."""
    proc = multiprocessing.get_context("fork").Process(target=_idle, daemon=True)
    proc.start()
    out.append(proc)


def test_the_installing_process_takes_a_sigterm_and_a_forked_helper_dies_of_it():
    stopped = threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        on_stop_signals(lambda *_: stopped.set())
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.wait(5)  # ours: handled, not killed
        helpers: list = []
        thread = threading.Thread(target=_forked_from_a_thread, args=(helpers,))
        thread.start()
        thread.join()
        helper = helpers[0]
        time.sleep(0.2)  # it runs Python (its inherited handler) before the signal comes
        helper.terminate()
        helper.join(10)
        assert helper.exitcode == -signal.SIGTERM, "the forked helper ignored SIGTERM"
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
