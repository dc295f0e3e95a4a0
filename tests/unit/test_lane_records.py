"""A peer of P fragments publishes one record and fetches the swarm's records once for all of its fragments
(p2pdiloco.swarm.records.LaneBeat): each fragment's merger sees its own fragment's records, as if the fragment
were a swarm of its own. P heartbeats, a store and a fetch of ~40 KB each every beat, were the control floor of
issue 50's peak-bandwidth runs (docs/fragments.md)."""

import dataclasses
import threading

from p2pdiloco.protocol.remote import PeerRecord, parse_peer_record
from p2pdiloco.swarm import records
from p2pdiloco.swarm.signing import Identity
from tests.harness.dht import StoringDHT

ME, THEM = Identity.fresh(), Identity.fresh()


def peer_of_three(identity, versions=(3, 5, 7), **fields) -> PeerRecord:
    lanes = [dict(version=v, digest=f"{v:06d}abcdef") for v in versions[1:]]
    return PeerRecord(peer=identity.peer_id, name="x", version=versions[0], digest=f"{versions[0]:06d}abcdef",
                      lanes=lanes, **fields)


def test_each_fragment_reads_and_writes_its_own_fields_of_the_one_record():
    beat = records.Heartbeat(None, "run", peer_of_three(ME, loss=2.0), ME)
    lanes = [records.LaneBeat(beat, i) for i in range(3)]
    assert [lane.record.version for lane in lanes] == [3, 5, 7] and lanes[2].record.lanes == []
    lanes[2].note(version=8, digest="000008abcdef", ready=8, loss=9.0)  # the loss is the peer's: fragment 0 tells it
    lanes[0].note(ready=3, loss=1.5)
    assert (lanes[2].record.version, lanes[2].record.ready, lanes[2].record.loss) == (8, 8, 1.5)
    assert (lanes[0].record.version, lanes[0].record.ready, lanes[1].record.ready) == (3, 3, -1)
    sent = parse_peer_record(beat.record.value())  # what goes out, as others parse it
    assert [sent.lane(i) for i in range(4)] == [beat.record.lane(i) for i in range(3)] + [None]
    assert sent.lane(2).ready == 8 and sent.lane(1).ready == -1


def test_fragments_polling_side_by_side_make_one_fetch_and_each_sees_its_own_fragment(monkeypatch):
    fetches = []
    monkeypatch.setattr(records, "fetch_records",
                        lambda dht, run_id, **_: fetches.append(run_id) or [peer_of_three(THEM)])
    monkeypatch.setattr(records, "SHARED_FETCH_AGE", 60.0)  # "side by side", however slowly the threads start
    beat = records.Heartbeat(None, "run", peer_of_three(ME), ME)
    lanes = [records.LaneBeat(beat, i) for i in range(3)]
    seen, threads = {}, [threading.Thread(target=lambda i=i: seen.update({i: lanes[i].fetch()})) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fetches == ["run"] and {i: [r.version for r in got] for i, got in seen.items()} == {0: [3], 1: [5], 2: [7]}
    assert [r.version for r in lanes[1].records()] == [5]  # the heartbeat's view is that fetch too
    monkeypatch.setattr(records, "SHARED_FETCH_AGE", 0.0)  # a poll later than the shared age fetches anew
    lanes[0].fetch()
    assert fetches == ["run", "run"]


def test_a_fragment_sees_whether_another_peer_looks_for_an_island_for_it(monkeypatch):
    """What lets a restarted peer's fragment go along with its peers' island (`Streams.due(looking=…)`): another
    peer's `ready` in that fragment's lane, never our own, and none of another fragment's."""
    them = peer_of_three(THEM)
    them = dataclasses.replace(them, lanes=[them.lanes[0], {**them.lanes[1], "ready": 7}])
    monkeypatch.setattr(records, "fetch_records", lambda dht, run_id, **_: [them, peer_of_three(ME, ready=3)])
    beat = records.Heartbeat(None, "run", peer_of_three(ME, ready=3), ME)
    beat.fetch()
    assert [records.LaneBeat(beat, i).others_looking() for i in range(3)] == [False, False, True]


def test_the_heartbeat_starts_and_withdraws_once_whichever_fragment_asks():
    dht = StoringDHT()  # its fetches fail (it has no get): the beat goes on, as with a DHT that is down
    beat = records.Heartbeat(dht, "run", peer_of_three(ME), ME)
    lanes = [records.LaneBeat(beat, i) for i in range(3)]
    for lane in lanes:
        lane.start()  # a thread starts once: a second start would raise
    for lane in lanes:
        lane.stop()
    assert sum(value is None for _, _, value in dht.stored) == 1  # one withdrawal, not one a fragment


def test_no_store_a_beat_sends_as_we_leave_outlives_our_withdrawal():
    """A beat that passed its check of the stop just before we left stored our record again after the
    withdrawal, dated later, so the DHT (which keeps the later of two stores of a subkey) kept a left peer's record
    for its lifetime. Now a store is dated under the lock the stop takes, and none is sent once it is set."""
    dht = StoringDHT()
    beat = records.Heartbeat(dht, "run", peer_of_three(ME), ME)
    beat.publish()
    beat.stop()
    beat.publish()  # what the beat's thread does next if it had checked the stop a moment before
    withdrawal = max(e for (_, _, value), e in zip(dht.stored, dht.expirations) if value is None)
    assert all(e <= withdrawal for (_, _, value), e in zip(dht.stored, dht.expirations) if value is not None)
    assert dht.stored[-1][2] is None


def test_a_peer_of_eight_fragments_publishes_its_sketches_in_fp32_and_its_lanes_without_their_defaults():
    """Every fetch takes each peer's whole record from every replica it asks, and a round waiting for peers polls
    four times a second: with float64 lists for its 8 sketches, a record of 8 fragments was 5.8 KB in msgpack."""
    import numpy as np
    from hivemind.utils.serializer import MSGPackSerializer

    from p2pdiloco.core.consensus import SKETCH_DIM, sketch_dim

    sketch = [((i * 7919) % 1000 - 500) / 3.0 for i in range(SKETCH_DIM)]  # no value fp32 holds exactly
    lanes = [dict(version=12, digest=f"{j:016x}", merged_by=4, sketch=sketch, rounds=12, island=4, bytes_sent=1 << 23)
             for j in range(1, 8)]
    record = PeerRecord(peer=ME.peer_id, name="p0", version=12, digest="0123456789abcdef", sketch=sketch, merged_by=4,
                        rounds=12, island=4, bytes_sent=1 << 26, lanes=lanes,
                        settings=dict(model="tiny", fragments="8"))
    sent = MSGPackSerializer.dumps(record.value())
    assert len(sent) < 0.55 * len(MSGPackSerializer.dumps(dataclasses.asdict(record)))
    assert all("ready" not in lane and "merging" not in lane for lane in record.value()["lanes"])  # at -1: left out
    back = parse_peer_record(MSGPackSerializer.loads(sent))
    for i in range(8):
        assert back.lane(i).sketch == [float(np.float32(x)) for x in sketch]
        assert dataclasses.replace(back.lane(i), sketch=sketch) == record.lane(i)
    # with the sketches' budget shared by the fragments (core.consensus.sketch_dim): 8 values each, 1.1 KB in all
    short = sketch[:sketch_dim(8)]
    shared = dataclasses.replace(record, sketch=short, lanes=[dict(lane, sketch=short) for lane in lanes])
    assert len(MSGPackSerializer.dumps(shared.value())) < 0.4 * len(sent)


def test_a_poll_reads_our_nodes_own_copy_only_while_others_stores_reach_it(monkeypatch):
    """A round's poll takes our node's own copy (records.POLL_LAG) where it holds another peer's record stored since
    our last fetch of every copy, within a beat: stores reach our node, a replica. Otherwise, and for joins,
    downloads and any `fetch`, every replica's copy; a node in client mode, which holds no replica, always reads
    every copy: a late joiner in client mode once polled its own copy at join and saw no live peer ahead of it."""
    import concurrent.futures
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    class GetDHT:
        def __init__(self):
            self.gets, self.copy = [], {}

        def get(self, key, return_future=False, **fresh):
            self.gets.append(fresh)
            future = concurrent.futures.Future()
            future.set_result(SimpleNamespace(value=dict(self.copy)))
            return future

        def stored(self, identity, age: float) -> None:  # `identity`'s record came `age` seconds ago
            record = peer_of_three(identity)
            self.copy[identity.subkey] = SimpleNamespace(value=record.value(),
                                                         expiration_time=get_dht_time() - age + records.TTL)

    every_copy, dht = dict(latest=True), GetDHT()
    beat = records.Heartbeat(dht, "run", peer_of_three(ME), ME)
    dht.stored(THEM, age=0.1)
    assert [r.peer for r in beat.poll()] == [THEM.peer_id]  # before any fetch: came by a store
    assert len(dht.gets) == 1 and dht.gets[0]["latest"] is False and "sufficient_expiration_time" in dht.gets[0]
    beat.fetch(max_age=60.0)  # a poll's view never stands in for every copy
    assert dht.gets[-1] == every_copy and len(dht.gets) == 2
    beat.poll(max_age=60.0)  # every copy stands in for a poll
    assert len(dht.gets) == 2
    beat.poll()  # THEM's record came before that fetch: our copy may be its cache, and the fetch serves ...
    assert len(dht.gets) == 3 and dht.gets[-1]["latest"] is False
    monkeypatch.setattr(records, "COPY_POLL_AGE", 0.0)
    beat.poll()  # ... until it is COPY_POLL_AGE old: then every copy
    assert dht.gets[-2]["latest"] is False and dht.gets[-1] == every_copy and len(dht.gets) == 5
    dht.stored(THEM, age=0.0)  # a store since our fetch: we are a replica
    beat.poll()
    assert len(dht.gets) == 6 and dht.gets[-1]["latest"] is False
    dht.stored(THEM, age=records.HEARTBEAT + 1)  # nothing of the last beat: every copy
    beat.poll()
    assert dht.gets[-1] == every_copy and len(dht.gets) == 8
    monkeypatch.setattr(records, "SHARED_FETCH_AGE", 60.0)  # "side by side", however slowly this runs
    lane, count = records.LaneBeat(beat, 1), len(dht.gets)
    lane.fetch(), lane.poll()
    assert len(dht.gets) == count  # both within SHARED_FETCH_AGE of a read that may stand in for them
    client = records.Heartbeat(dht, "run", peer_of_three(ME, client_mode=True), ME)
    dht.stored(THEM, age=0.0)
    client.poll()
    assert dht.gets[-1] == every_copy
