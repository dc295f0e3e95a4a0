"""The averager's command pipe survives messages that arrive in pieces (hivemind leaves it non-blocking)."""

import multiprocessing as mp
import os
import pickle
import struct
import threading
import time

import pytest

from p2pdiloco.swarm.island_rounds import WholeMessagePipe


def send_in_two_writes(connection, obj, pause: float = 0.2) -> threading.Thread:
    """What multiprocessing does for a message over 16 KiB (length, then body), with the body late, as on a
    loaded machine."""
    body = pickle.dumps(obj)
    os.write(connection.fileno(), struct.pack("!i", len(body)))

    def rest():
        time.sleep(pause)
        os.write(connection.fileno(), body)

    thread = threading.Thread(target=rest)
    thread.start()
    return thread


def nonblocking_pair():
    inner, outer = mp.Pipe(duplex=True)
    os.set_blocking(inner.fileno(), False)  # what uvloop's add_reader leaves behind in hivemind's averager
    return inner, outer


def test_a_plain_read_of_a_split_message_fails_on_a_nonblocking_pipe():
    """The failure the wrapper exists for: without it the read breaks off midway through the message."""
    inner, outer = nonblocking_pair()
    writer = send_in_two_writes(outer, ("_step", [], {"gather": b"x" * 24_000}))
    assert inner.poll(5)
    with pytest.raises(BlockingIOError):
        inner.recv()
    writer.join()


def test_the_averagers_pipe_reads_a_split_message_whole_and_stays_nonblocking():
    inner, outer = nonblocking_pair()
    pipe = WholeMessagePipe(inner)
    message = ("_step", [], {"gather": b"x" * 24_000})
    writer = send_in_two_writes(outer, message)
    assert pipe.poll(5)
    assert pipe.recv() == message
    writer.join()
    assert not os.get_blocking(inner.fileno())  # uvloop's reader keeps the descriptor as it set it
    outer.send(("_shutdown", [1.0], {}))  # and the stream stays in step: the next message reads whole
    assert pipe.recv() == ("_shutdown", [1.0], {})
    assert pipe.fileno() == inner.fileno()
