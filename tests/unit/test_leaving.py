"""A leaving peer's waits end when it closes: an outcome that can no longer arrive (its averager or fetch
loop is gone) must not hold the process past its leave bound."""

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from p2pdiloco.protocol.outcomes import Contribution, RolledBack
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.runtime.waiting import LeavingError, result_unless_closed
from p2pdiloco.swarm.rounds import SwarmMerger, merging_announcer
from p2pdiloco.swarm.statefetch import StateFetcher
from p2pdiloco.swarm.transfer import TransferError
from tests.harness.merger import fake_merger


def close_after(seconds: float, close) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), close()))
    thread.start()
    return thread


def test_a_round_waiting_on_a_step_that_never_resolves_gives_up_when_the_merger_closes():
    never = concurrent.futures.Future()
    closed = threading.Event()
    closer = close_after(0.3, closed.set)
    start = time.monotonic()
    with pytest.raises(LeavingError):
        result_unless_closed(never, timeout=60.0, closed=closed.is_set)
    assert time.monotonic() - start < 2.0
    closer.join()


def test_result_unless_closed_returns_the_result_and_keeps_its_timeout():
    done = concurrent.futures.Future()
    done.set_result({"verified": True})
    assert result_unless_closed(done, timeout=1.0, closed=threading.Event().is_set) == {"verified": True}
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        result_unless_closed(concurrent.futures.Future(), timeout=0.5, closed=threading.Event().is_set)
    assert 0.4 < time.monotonic() - start < 2.0


def test_a_peer_says_in_its_record_when_its_island_closed_to_others_while_it_waits_for_the_result():
    """protocol.round's wait_for_island needs the record field `merging`: set once the all-reduce began, once."""

    class Beat:
        def __init__(self):
            self.record, self.updates = PeerRecord(peer="p", name="p", version=3, digest="abcdef"), []

        def update(self, **fields):
            self.updates.append(fields)
            self.record = PeerRecord(**{**self.record.__dict__, **fields})

    control, beat = SimpleNamespace(began_allreduce=False), Beat()
    future, polls = concurrent.futures.Future(), []

    def on_poll():
        polls.append(1)
        merging_announcer(control, beat, 3)()
        if len(polls) == 2:
            control.began_allreduce = True  # the group formed: matchmaking is over
        if len(polls) == 5:
            future.set_result("reduced")

    assert result_unless_closed(future, timeout=10.0, closed=threading.Event().is_set, poll=0.01,
                                on_poll=on_poll) == "reduced"
    assert beat.updates == [dict(merging=3)] and beat.record.merging == 3
    # withdrawn with the state the island made, never before: no moment shows neither the island nor its merge.
    # The round's end keeps it (withdrawn there, peers that had waited forked: seen on the H200 machine)
    merger = fake_merger(4, heartbeat=beat, peer="p", client_mode=True, initial_peers=("/ip4/127.0.0.1/tcp/1",))
    merger._drive = lambda rnd: RolledBack(reason="test")
    contribution = Contribution.of(torch.zeros(4), tokens=1, steps=1, version=3, peer="p", name="p", digest="abcdef")
    assert isinstance(SwarmMerger.merge(merger, contribution), RolledBack)
    assert beat.record.merging == 3 and beat.record.ready == -1
    SwarmMerger.publish_state(merger, 4, "bbbbbb", [])
    assert beat.record.merging == -1 and beat.record.version == 4


class HangingDHT:
    async def replicate_p2p(self):
        await asyncio.Event().wait()  # a daemon that never answers


def test_a_state_fetch_in_progress_ends_when_the_fetcher_closes():
    fetcher = StateFetcher(HangingDHT(), get_stub=None, part_timeout=60.0)
    closer = close_after(0.5, fetcher.close)
    start = time.monotonic()
    with pytest.raises(TransferError, match="closed"):
        fetcher.fetch(["donor"], (3, "digest"), total=1000, timeout=60.0)
    assert time.monotonic() - start < 3.0
    closer.join()


def test_a_state_fetch_in_progress_ends_when_the_peer_is_asked_to_leave():
    """Not only when the fetcher closes: a download of a large state takes minutes, and SIGTERM must not wait."""
    fetcher = StateFetcher(HangingDHT(), get_stub=None, part_timeout=60.0)
    asked = threading.Event()
    asker = close_after(0.5, asked.set)
    start = time.monotonic()
    with pytest.raises(TransferError, match="left while fetching"):
        fetcher.fetch(["donor"], (3, "digest"), total=1000, timeout=60.0, leaving=asked.is_set)
    assert time.monotonic() - start < 3.0
    asker.join()
    fetcher.close()


def test_hivemind_s_one_donor_download_is_cancelled_when_the_peer_is_asked_to_leave():
    never = concurrent.futures.Future()
    stop, closed = threading.Event(), threading.Event()
    merger = SimpleNamespace(stop=stop, closed=closed, averager=SimpleNamespace(
        load_state_from_peers=lambda wait, timeout: never if not wait else pytest.fail("it would block")))
    merger._stopping = SwarmMerger._stopping.__get__(merger)
    asker = close_after(0.5, stop.set)
    start = time.monotonic()
    assert SwarmMerger.load_state(merger, timeout=60.0) is None
    assert time.monotonic() - start < 3.0 and never.cancelled()
    asker.join()
