"""Over a real DHT: a round's poll (records.POLL_LAG) reads our node's own copy of the records, which stores reach as
they are made, instead of asking every replica: it sees a peer's new record as soon as a full fetch would, and costs
no request. Four polls a second of every replica's copy were most of a peer's bytes between rounds at 8 fragments
(docs/fragments.md)."""

import dataclasses
import time

import pytest

from p2pdiloco.config import SwarmConfig
from p2pdiloco.ops.testbed import loopback_bytes_sent
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.swarm import node
from p2pdiloco.swarm.records import POLL_LAG, Heartbeat, fetch_records
from p2pdiloco.swarm.signing import Identity

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

BASE = SwarmConfig(run_id="polls", connect_timeout=20.0)


def bytes_of(calls: int, fetch) -> int:
    before = loopback_bytes_sent()
    for _ in range(calls):
        fetch()
        time.sleep(0.05)
    return loopback_bytes_sent() - before


def test_a_poll_sees_a_new_record_at_once_and_asks_no_replica_while_our_copy_is_fresh():
    ids = [Identity.fresh() for _ in range(3)]
    started = [node.start_dht(BASE, ids[0])]
    try:
        cfg = dataclasses.replace(BASE, initial_peers=tuple(node.visible_addresses(started[0])))
        started += [node.start_dht(cfg, identity) for identity in ids[1:]]
        beats = [Heartbeat(dht, BASE.run_id, PeerRecord(i.peer_id, f"p{n}", 3, "abcdef0123456789"), i)
                 for n, (dht, i) in enumerate(zip(started, ids))]
        for beat in beats:
            beat.publish()
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
    finally:
        for dht in started:
            node.shutdown(dht)
