"""Over a real DHT: a round's poll (records.POLL_LAG) reads our node's own copy of the records, which stores reach as
they are made, instead of asking every replica: it sees a peer's new record as soon as a full fetch would, and costs
no request. Four polls a second of every replica's copy were most of a peer's bytes between rounds at 8 fragments
(docs/fragments.md)."""

import contextlib
import dataclasses
import time

import pytest

from p2pdiloco.config import SwarmConfig
from p2pdiloco.ops.testbed import loopback_bytes_sent
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.swarm import node
from p2pdiloco.swarm.records import COPY_POLL_AGE, HEARTBEAT, POLL_LAG, Heartbeat, fetch_records
from p2pdiloco.swarm.signing import Identity
from tests.harness.swarm import wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

BASE = SwarmConfig(run_id="polls", connect_timeout=20.0)


def bytes_of(calls: int, fetch) -> int:
    before = loopback_bytes_sent()
    for _ in range(calls):
        fetch()
        time.sleep(0.05)
    return loopback_bytes_sent() - before


@contextlib.contextmanager
def three_peers():
    """Three DHT nodes, each with a peer's heartbeat (not started) whose record it stored once."""
    ids = [Identity.fresh() for _ in range(3)]
    started = [node.start_dht(BASE, ids[0])]
    beats = []
    try:
        cfg = dataclasses.replace(BASE, initial_peers=tuple(node.visible_addresses(started[0])))
        started += [node.start_dht(cfg, identity) for identity in ids[1:]]
        beats = [Heartbeat(dht, BASE.run_id, PeerRecord(i.peer_id, f"p{n}", 3, "abcdef0123456789"), i)
                 for n, (dht, i) in enumerate(zip(started, ids))]
        for beat in beats:
            beat.publish()
        yield ids, started, beats
    finally:
        for beat in beats:
            beat.stop()
        for dht in started:
            node.shutdown(dht)


def test_a_poll_sees_a_new_record_at_once_and_asks_no_replica_while_our_copy_is_fresh():
    with three_peers() as (ids, started, beats):
        watcher = started[2]
        deadline = time.monotonic() + 30
        while len(fetch_records(watcher, BASE.run_id)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(fetch_records(watcher, BASE.run_id)) == 3

        beats[0].record = PeerRecord(ids[0].peer_id, "p0", 4, "0000000000000004", ready=4)
        beats[0].publish()  # returns once the replicas have it: our copy among them
        polled = {r.peer: (r.version, r.ready) for r in fetch_records(watcher, BASE.run_id, lag=POLL_LAG)}
        assert polled[ids[0].peer_id] == (4, 4)

        calls = 12
        every_copy = bytes_of(calls, lambda: fetch_records(watcher, BASE.run_id))
        for beat in beats:
            beat.publish()  # a store just made: our copy is fresh
        polls = bytes_of(calls, lambda: fetch_records(watcher, BASE.run_id, lag=POLL_LAG))
        assert every_copy > 3_000 * calls and polls < every_copy / 20, (every_copy, polls)  # ~8 KB a fetch here


def test_a_beat_and_a_poll_read_their_own_copy_only_while_others_stores_reach_it():
    """Every node of 3 is a replica. A poll or a beat reads our node's own copy where another peer's record came
    to it by a store since our last fetch, within a beat: no fetch of every copy. Where it holds only what our last
    fetch brought (as a node that is no replica holds a cache), or records older than a beat, they fetch every
    copy: a poll at most every COPY_POLL_AGE."""
    with three_peers() as (ids, _, beats):
        watcher = beats[2]
        wait_for(lambda: len(watcher.fetch()) == 3, 30, "the three records", every=0.1)
        fetched = watcher.fetches
        assert len(watcher.poll()) == 3 and watcher.fetches == fetched  # the fetch of a moment ago serves
        time.sleep(COPY_POLL_AGE + 0.1)
        watcher.poll()  # our copy holds nothing stored since that fetch: every copy again
        assert watcher.fetches == fetched + 1

        time.sleep(HEARTBEAT + 0.5)  # the others' records, stored once, are now older than a beat
        watcher.start()
        wait_for(lambda: watcher.fetches >= fetched + 2, 2 * HEARTBEAT, "a beat's fetch of every copy", every=0.1)
        assert len(watcher.records()) == 3

        for beat in beats[:2]:
            beat.start()
        time.sleep(HEARTBEAT + 0.5)  # a beat of theirs has reached our copy since
        fetched = watcher.fetches
        beats[0].update(version=5, digest="0000000000000005")
        wait_for(lambda: {r.peer: r.version for r in watcher.poll()}.get(ids[0].peer_id) == 5, HEARTBEAT,
                 "a poll to show p0's new version", every=0.1)
        wait_for(lambda: {r.peer: r.version for r in watcher.records()}.get(ids[0].peer_id) == 5,
                 2 * HEARTBEAT + 1, "the beat's view to show it", every=0.1)
        time.sleep(HEARTBEAT)
        assert watcher.fetches == fetched, "a beat or a poll fetched every copy while our own copy was current"
        assert {r.peer for r in watcher.records()} == {i.peer_id for i in ids}
