"""What remote peers publish or gather is never trusted: malformed values are dropped, never a crash."""

import concurrent.futures
import dataclasses
import math
import threading
from typing import Optional

import pytest

from p2pdiloco.core.consensus import SKETCH_DIM, consensus_distance
from p2pdiloco.protocol.remote import WIRE_VERSION, pack_sketch, parse_peer_record as parse_record
from p2pdiloco.protocol.timing import agreed_deadline
from p2pdiloco.swarm.signing import Identity

ME = Identity.fresh()
GOOD = dict(peer=ME.peer_id, name="a", version=3, digest="abcdef0123456789", ready=-1,
            sketch=pack_sketch([0.5] * SKETCH_DIM), wire=WIRE_VERSION)


@pytest.mark.parametrize("change", [
    dict(version="3"), dict(digest=None), dict(digest=""), dict(ready=1.5), dict(peer=7),
    dict(sketch=["x"] * 4), dict(sketch=pack_sketch([math.nan])), dict(sketch=pack_sketch([math.inf, 1.0])),
    dict(sketch=pack_sketch([1.0] * (SKETCH_DIM + 1))), dict(sketch="abc"), dict(sketch=b"abc"),
    dict(sketch=[0.5] * SKETCH_DIM),  # a list of numbers: wire version 5's sketch, twice the bytes
    dict(lanes=[dict(version=1, digest="abcdef", sketch=[0.5])]),
    dict(unexpected_field=1), dict(merging=-2), dict(merging="3"), dict(merging=True),
    dict(merged_by=-1), dict(merged_by=1 << 20), dict(lanes="x"), dict(lanes=[dict(version=1)]),
    dict(lanes=[dict(version=1, digest="abcdef", loss=2.0)]), dict(lanes=[dict(version=1, digest="abcdef", ready=-2)]),
    dict(lanes=[dict(version=1, digest="abcdef")] * 256),
])
def test_a_malformed_record_is_dropped(change):
    assert parse_record({**GOOD, **change}) is None


def test_well_formed_records_parse_and_give_a_distance():
    a, b = parse_record(GOOD), parse_record({**GOOD, "digest": "ffffff0000000000",
                                               "sketch": pack_sketch([1.5] * SKETCH_DIM)})
    assert a is not None and b is not None and parse_record(None) is None and parse_record([1, 2]) is None
    assert a.merging == -1 and parse_record({**GOOD, "merging": 3}).merging == 3
    assert consensus_distance([(a.version, a.digest, a.sketch), (b.version, b.digest, b.sketch)]) == pytest.approx(8.0)


def test_hostile_budgets_can_neither_hang_nor_cut_short_a_round():
    assert agreed_deadline([5.0, 7.5], cap=60.0) == 7.5
    assert agreed_deadline([5.0, 1e9], cap=60.0) == 60.0  # capped
    for bad in (math.nan, math.inf, -1.0, 0.0, "soon", None):
        assert agreed_deadline([5.0, bad], cap=60.0) == 60.0
    assert agreed_deadline([], cap=60.0) == 60.0


def test_heartbeat_never_makes_the_caller_wait_on_the_dht_and_keeps_a_view_of_peer_records():
    """The training thread calls `update` after every round: a slow DHT must not stall it."""
    import threading
    import time
    from types import SimpleNamespace

    from p2pdiloco.swarm.records import Heartbeat

    class SlowDHT:
        def __init__(self):
            self.stored, self.table, self.lock = [], {}, threading.Lock()

        def store(self, key, subkey, value, expiration_time, return_future):
            time.sleep(1.0)  # a loaded DHT
            with self.lock:
                self.stored.append(value)
                self.table[subkey] = SimpleNamespace(value=value)
            return done(True)

        def get(self, key, latest=True, return_future=False, **fresh):
            with self.lock:
                return done(SimpleNamespace(value=dict(self.table)))

    dht = SlowDHT()
    beat = Heartbeat(dht, "run", parse_record(GOOD), ME).start()
    try:
        started = time.monotonic()
        beat.update(version=9)
        assert time.monotonic() - started < 0.2
        deadline = time.monotonic() + 10
        while not any(v["version"] == 9 for v in dht.stored) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(v["version"] == 9 for v in dht.stored)  # published soon after, off the caller's thread
        while not beat.records() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.version for r in beat.records()][-1] in (3, 9)
    finally:
        beat.stop()


def done(value):
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def test_a_dead_dht_never_holds_a_leaving_peer():
    """A terminal's Ctrl-C reaches the DHT's daemon too: hivemind's calls then never answer. Withdrawing our
    record and reading others' must still end in bounded time."""
    import time

    from p2pdiloco.swarm import records

    class DeadDHT:
        def store(self, *args, return_future, **kwargs):
            return concurrent.futures.Future()  # never resolves

        def get(self, *args, return_future, **kwargs):
            return concurrent.futures.Future()

    beat = records.Heartbeat(DeadDHT(), "run", records.PeerRecord(**GOOD), ME)
    started = time.monotonic()
    beat.stop()
    assert time.monotonic() - started < records.WITHDRAW_TIMEOUT + 1.0
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        records.fetch_records(DeadDHT(), "run", timeout=0.5)
    assert time.monotonic() - started < 2.0


def test_a_peer_that_sees_no_other_asks_its_initial_peers_again_every_few_seconds_and_not_otherwise(monkeypatch):
    from p2pdiloco.swarm import records

    asked, now = [], [100.0]
    monkeypatch.setattr(records.time, "monotonic", lambda: now[0])
    me = records.PeerRecord(**GOOD)
    beat = records.Heartbeat(None, "run", me, ME, rejoin=lambda: asked.append(now[0]))
    beat._records = [me]  # only ourselves: the node we knew may have restarted
    beat._rejoin_if_alone()
    beat._rejoin_if_alone()  # not again within REJOIN_EVERY
    now[0] += records.REJOIN_EVERY
    beat._rejoin_if_alone()
    assert asked == [100.0, 100.0 + records.REJOIN_EVERY]
    beat._records = [me, dataclasses.replace(me, peer="someone else")]
    now[0] += records.REJOIN_EVERY
    beat._rejoin_if_alone()
    assert len(asked) == 2  # another peer is seen: nothing to find again


class StallingDHT:
    """Answers from its table until `stall` is set; then no call of it ever answers (a DHT get that hangs)."""

    def __init__(self):
        from types import SimpleNamespace
        self.table, self.stall, self._item = {}, threading.Event(), SimpleNamespace
        self.own_copy_delay: Optional[float] = None  # when set: a stalled DHT still answers from our node's copy

    def store(self, key, subkey, value, expiration_time, return_future):
        self.table[subkey] = self._item(value=value, expiration_time=expiration_time)
        return done(True)

    def get(self, key, return_future, latest=True, **fresh):
        if self.stall.is_set() and (latest or self.own_copy_delay is None):
            return concurrent.futures.Future()
        answer = self._item(value=dict(self.table))
        if latest or not self.own_copy_delay:
            return done(answer)
        slow = concurrent.futures.Future()  # our node's own copy, read slowly: the wait goes on to every copy's
        threading.Timer(self.own_copy_delay, slow.set_result, [answer]).start()
        return slow


@pytest.mark.parametrize("read", ["fetch", "poll"])
def test_a_stalled_read_of_the_records_gives_the_recent_view_after_a_bounded_wait(read, monkeypatch):
    """A DHT get that hung for over 10 s once failed a round's start, and so the round of every peer that waited
    for ours. A recent view now stands in after VIEW_WAIT; without one, the read waits for the DHT as before."""
    import time

    from p2pdiloco.swarm import records

    monkeypatch.setattr(records, "VIEW_WAIT", 0.3)
    monkeypatch.setattr(records, "DHT_CALL_TIMEOUT", 0.8)
    dht, other = StallingDHT(), Identity.fresh()
    records.Heartbeat(dht, "run", parse_record({**GOOD, "peer": other.peer_id}), other).publish()
    beat = records.Heartbeat(dht, "run", parse_record(GOOD), ME)

    dht.stall.set()
    started = time.monotonic()
    with pytest.raises(TimeoutError):  # no view yet (a join): the DHT's own bound, then an error
        getattr(beat, read)()
    assert 0.7 < time.monotonic() - started < 1.5

    dht.stall.clear()
    assert [r.peer for r in beat.fetch()] == [other.peer_id]
    dht.stall.set()
    started = time.monotonic()
    assert [r.peer for r in getattr(beat, read)()] == [other.peer_id]  # the view of a moment ago
    assert time.monotonic() - started < 0.7  # VIEW_WAIT (0.3 s) and a margin: never the DHT's bound


def test_a_poll_s_steps_share_one_bound(monkeypatch):
    """A poll reads our node's own copy, then, where that cannot be trusted, every copy: the bound is the two
    together, not each (a slow own copy, then a stall, once took VIEW_WAIT for each step)."""
    import time

    from p2pdiloco.swarm import records

    monkeypatch.setattr(records, "VIEW_WAIT", 1.0)  # with 0.4 s either side of the bound: it runs beside another test
    monkeypatch.setattr(records, "COPY_POLL_AGE", 0.0)  # every copy is read again, not taken from the fetch below
    dht, other = StallingDHT(), Identity.fresh()
    records.Heartbeat(dht, "run", parse_record({**GOOD, "peer": other.peer_id}), other).publish()
    beat = records.Heartbeat(dht, "run", parse_record(GOOD), ME)
    beat.fetch()
    for item in dht.table.values():  # stored before that fetch: our copy cannot tell us anything newer
        item.expiration_time -= 1.0
    dht.own_copy_delay = 0.8
    dht.stall.set()
    started = time.monotonic()
    assert [r.peer for r in beat.poll()] == [other.peer_id]
    assert time.monotonic() - started < 1.4  # 0.8 s for our copy, then at most the 0.2 s left: not 0.8 + 1.0


def test_a_read_behind_a_stalled_one_waits_no_longer_than_for_the_dht(monkeypatch):
    import threading
    import time

    from p2pdiloco.swarm import records

    monkeypatch.setattr(records, "VIEW_WAIT", 0.3)
    dht, other = StallingDHT(), Identity.fresh()
    records.Heartbeat(dht, "run", parse_record({**GOOD, "peer": other.peer_id}), other).publish()
    beat = records.Heartbeat(dht, "run", parse_record(GOOD), ME)
    beat.fetch()
    dht.stall.set()
    stalled = threading.Thread(target=lambda: pytest.raises(TimeoutError, beat._read, 0.0, 2.0), daemon=True)
    stalled.start()  # the beat's own read, holding the lock for its 2 s
    time.sleep(0.1)
    started = time.monotonic()
    assert [r.peer for r in beat.fetch()] == [other.peer_id]
    assert time.monotonic() - started < 0.6
    stalled.join()
