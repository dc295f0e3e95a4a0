"""Multi-donor, resumable state transfer, with fake donors (no network)."""

import asyncio
import math

import pytest
import torch

from p2pdiloco.swarm.transfer import STREAMS_PER_DONOR, TransferError, fetch_parts, part_size

TOTAL = 10_000
STATE = torch.arange(TOTAL, dtype=torch.float32)
META = dict(version=7, digest="abc")


def donor_pool(dies_after=None, hangs=(), lies=(), log=None):
    """fetch_part for donors that serve STATE; `dies_after[d] = k`: donor d fails from its (k+1)-th part on."""
    served = {}

    async def fetch_part(donor, start, length):
        served[donor] = served.get(donor, 0) + 1
        if log is not None:
            log.append((donor, start))
        await asyncio.sleep(0.001)
        if dies_after and donor in dies_after and served[donor] > dies_after[donor]:
            raise ConnectionResetError("donor died mid-transfer")
        if donor in hangs:
            await asyncio.sleep(60)
        if donor in lies:
            return dict(version=8, digest="zzz"), torch.zeros(length)
        return dict(META), STATE[start:start + length].clone()

    return fetch_part


def run(donors, fetch_part, size=1000, timeout=5.0, streams=1):
    """One part in flight per donor unless `streams` says otherwise: the resuming tests count parts exactly."""
    return asyncio.run(fetch_parts(donors, (7, "abc"), TOTAL, fetch_part, part_timeout=timeout, size=size,
                                   streams=streams))


def test_parts_come_from_every_donor_and_assemble_exactly():
    t = run(["a", "b", "c"], donor_pool())
    assert torch.equal(t.flat, STATE) and t.metadata == META
    assert set(t.parts_by_donor) == {"a", "b", "c"} and sum(t.parts_by_donor.values()) == 10


def test_a_donor_dying_mid_transfer_costs_only_its_part_in_flight():
    log = []
    t = run(["a", "b"], donor_pool(dies_after={"a": 2}, log=log))
    assert torch.equal(t.flat, STATE)
    assert t.parts_by_donor["a"] == 2 and t.parts_by_donor["b"] == 8 and "a" in t.failed_donors
    starts = [s for _, s in log]
    assert len(starts) == 11 and len(set(starts)) == 10  # one part fetched twice, the rest kept (resumed)


def test_a_frozen_donor_times_out_and_its_part_is_served_by_another():
    t = run(["frozen", "b"], donor_pool(hangs={"frozen"}), timeout=0.5)
    assert torch.equal(t.flat, STATE) and t.parts_by_donor["b"] == 10 and t.requeued_parts == 1


def test_a_donor_serving_another_state_is_dropped_not_mixed_in():
    t = run(["liar", "b"], donor_pool(lies={"liar"}), size=5000)
    assert torch.equal(t.flat, STATE) and t.metadata == META
    assert "liar" in t.failed_donors and "liar" not in t.parts_by_donor


def test_all_donors_failing_is_a_clear_error():
    with pytest.raises(TransferError, match="every donor failed"):
        run(["a", "b"], donor_pool(dies_after={"a": 0, "b": 1}))


def test_part_size_gives_each_stream_a_few_parts_within_bounds():
    assert part_size(1_900_000, 2, streams=1) == 237_500
    assert part_size(1_900_000, 1) == math.ceil(1_900_000 / (4 * STREAMS_PER_DONOR))
    assert part_size(1000, 4) == 1 << 16 and part_size(10**10, 1, streams=1) == 1 << 22
    assert part_size(10**10, 1) * STREAMS_PER_DONOR == 1 << 22  # a donor's parts in flight: MAX_PART in all


def test_each_donor_serves_several_parts_at_once_and_no_more():
    """One libp2p stream is held to its flow-control window over a long round trip; a donor's parts in flight
    add up (docs/bandwidth.md)."""
    in_flight, most = {}, {}

    async def fetch_part(donor, start, length):
        in_flight[donor] = in_flight.get(donor, 0) + 1
        most[donor] = max(most.get(donor, 0), in_flight[donor])
        await asyncio.sleep(0.005)
        in_flight[donor] -= 1
        return dict(META), STATE[start:start + length].clone()

    t = run(["a", "b"], fetch_part, size=250, streams=STREAMS_PER_DONOR)
    assert torch.equal(t.flat, STATE) and sum(t.parts_by_donor.values()) == 40
    assert most == {"a": STREAMS_PER_DONOR, "b": STREAMS_PER_DONOR}


def test_a_donor_is_given_no_more_parts_once_one_of_its_streams_failed():
    """Its other parts in flight may still arrive (each is checked on its own); it is not asked again."""
    calls = {"a": 0, "b": 0}

    async def fetch_part(donor, start, length):
        calls[donor] += 1
        if donor == "a" and calls["a"] > 2:
            raise ConnectionResetError("donor died mid-transfer")
        await asyncio.sleep(0.01)
        return dict(META), STATE[start:start + length].clone()

    t = run(["a", "b"], fetch_part, size=500, streams=4)
    assert torch.equal(t.flat, STATE) and "a" in t.failed_donors
    assert calls["a"] == 4 and t.parts_by_donor["a"] == 2 and t.requeued_parts == 2


def test_a_donor_serves_exactly_the_slice_asked_for_and_refuses_anything_else():
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.proto import averaging_pb2
    from hivemind.utils.streaming import combine_from_streaming

    from p2pdiloco.swarm.statefetch import PartServer, serializer

    params, momentum = torch.randn(3000), torch.randn(3000)

    async def get_state():
        return serializer.dumps(META), [params, momentum], None  # serialized, as hivemind's host channel does

    def ask(request) -> tuple[dict, torch.Tensor | None]:
        blob = request if isinstance(request, bytes) else serializer.dumps(request)

        async def collect():
            return [m async for m in PartServer(get_state).serve_part(averaging_pb2.DownloadData(metadata=blob))]

        messages = asyncio.run(collect())
        meta = serializer.loads(messages[0].metadata)
        parts = [m.tensor_part for m in messages if m.tensor_part.buffer]
        return meta, deserialize_torch_tensor(combine_from_streaming(parts)) if parts else None

    meta, chunk = ask(dict(version=7, digest="abc", start=2500, length=1000))  # across Θ and momentum
    assert meta["version"] == 7 and torch.equal(chunk, torch.cat([params, momentum])[2500:3500])
    assert "moved on" in ask(dict(version=6, digest="abc", start=0, length=10))[0]["error"]
    assert "beyond" in ask(dict(version=7, digest="abc", start=5990, length=100))[0]["error"]
    for hostile in (b"\xff\x00garbage", dict(version=7, digest="abc", start=-1, length=5),
                    dict(version=7, digest="abc", start=0, length=1 << 40), dict(version="7", start=0)):
        meta, chunk = ask(hostile)
        assert "error" in meta and chunk is None


def test_a_donor_keeps_serving_the_state_of_a_transfer_in_progress_after_it_moved_on():
    """Each part request keeps the snapshot alive: a transfer that takes longer than SNAPSHOT_SECONDS in all (a
    slow link) is not refused halfway. An idle snapshot expires, and the donor then says it moved on."""
    from hivemind.proto import averaging_pb2

    from p2pdiloco.swarm.statefetch import SNAPSHOT_SECONDS, PartServer, serializer

    now, state = [0.0], dict(META)

    async def get_state():
        return serializer.dumps(state), [torch.zeros(100), torch.zeros(100)], None

    server = PartServer(get_state, clock=lambda: now[0])

    def ask() -> dict:
        blob = serializer.dumps(dict(version=7, digest="abc", start=0, length=10))

        async def collect():
            return [m async for m in server.serve_part(averaging_pb2.DownloadData(metadata=blob))]
        return serializer.loads(asyncio.run(collect())[0].metadata)

    assert ask()["version"] == 7
    state["version"] = 8  # the donor moved on after the transfer began
    for _ in range(4):  # parts keep coming, each within the window: 4 × 0.8 × SNAPSHOT_SECONDS in all
        now[0] += 0.8 * SNAPSHOT_SECONDS
        assert ask()["version"] == 7
    now[0] += 1.5 * SNAPSHOT_SECONDS  # idle: the snapshot is gone
    assert "moved on" in ask()["error"]


def test_a_donor_asked_for_several_parts_at_once_takes_one_snapshot_for_them_all():
    from hivemind.proto import averaging_pb2

    from p2pdiloco.swarm.statefetch import PartServer, serializer

    taken = []

    async def get_state():
        taken.append(1)
        await asyncio.sleep(0.01)  # the host process hands the state over
        return serializer.dumps(dict(META)), [torch.arange(100.0), torch.arange(100.0)], None

    server = PartServer(get_state)

    async def ask(start):
        blob = serializer.dumps(dict(version=7, digest="abc", start=start, length=50))
        return [m async for m in server.serve_part(averaging_pb2.DownloadData(metadata=blob))]

    async def together():
        return await asyncio.gather(*(ask(s) for s in range(0, 200, 50)))
    answers = asyncio.run(together())
    assert len(taken) == 1 and all(serializer.loads(a[0].metadata)["version"] == 7 for a in answers)


def test_a_part_that_arrives_incomplete_is_asked_for_once_more_from_the_same_live_donor():
    from p2pdiloco.swarm.statefetch import IncompletePart, retry_incomplete

    calls = []

    async def flaky(donor, start, length):  # the first answer for part 0 lost its last message
        calls.append((donor, start))
        if (donor, start) == ("a", 0) and calls.count(("a", 0)) == 1:
            raise IncompletePart("shape '[1000]' is invalid for input of size 936")
        return dict(META), STATE[start:start + length].clone()

    t = run(["a"], retry_incomplete(flaky))
    assert torch.equal(t.flat, STATE) and not t.failed_donors and calls.count(("a", 0)) == 2
    t = run(["a", "b"], retry_incomplete(donor_pool(dies_after={"a": 2})))  # a dead donor is not retried
    assert torch.equal(t.flat, STATE) and "a" in t.failed_donors


def test_a_part_incomplete_twice_drops_its_donor():
    from p2pdiloco.swarm.statefetch import IncompletePart, retry_incomplete

    async def broken(donor, start, length):
        if donor == "bad":
            raise IncompletePart("always short")
        return dict(META), STATE[start:start + length].clone()

    t = run(["bad", "b"], retry_incomplete(broken))
    assert torch.equal(t.flat, STATE) and "always short" in t.failed_donors["bad"]


def test_state_donors_are_the_dialable_peers_holding_the_best_state():
    from p2pdiloco.protocol.remote import PeerRecord
    from p2pdiloco.protocol.download import state_donors

    def rec(peer, version, digest="aaaaaa", client=False):
        return PeerRecord(peer=peer, name=peer, version=version, digest=digest, client_mode=client)

    records = [rec("a", 5), rec("b", 5), rec("nat", 6, "bbbbbb", client=True), rec("c", 5, client=True), rec("d", 4)]
    assert state_donors(records, 0) == ((5, "aaaaaa"), ["a", "b"])  # the newer state sits behind a NAT only
    assert state_donors(records, 6) is None and state_donors([rec("c", 5, client=True)], 0) is None


def test_a_stream_waiting_for_a_part_when_its_donor_failed_elsewhere_does_not_ask_that_donor():
    """Four parts, two streams per donor: a's second stream is done at once and waits for a part while b's two
    are busy; a's first stream fails and hands its part back. The waiting stream must leave that part to b, not
    ask a, which has just failed, once more."""
    calls = {"a": [], "b": []}
    quarter = TOTAL // 4

    async def fetch_part(donor, start, length):
        calls[donor].append(start)
        if donor == "a" and start == 0:
            await asyncio.sleep(0.1)
            raise ConnectionResetError("donor died mid-transfer")
        await asyncio.sleep(0.3 if donor == "b" else 0.0)
        return dict(META), STATE[start:start + length].clone()

    async def go():
        return await fetch_parts(["a", "b"], (7, "abc"), TOTAL, fetch_part, part_timeout=5.0, size=quarter, streams=2)
    t = asyncio.run(go())
    assert torch.equal(t.flat, STATE) and "a" in t.failed_donors
    assert sorted(calls["a"]) == [0, quarter] and 0 in calls["b"], calls
