"""ExactAverager's hooks on hivemind's RPCs, driven without a network: the checks on every fp32 part it reduces,
and the members it turns away at matchmaking."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.core import exact
from p2pdiloco.protocol.island import PenaltyBox, plan_island
from p2pdiloco.protocol.remote import Expect, parse_island
from p2pdiloco.swarm.averager import REFUSE_SECONDS, ExactAverager
from p2pdiloco.swarm.partchecks import ExactPartCheck, basic_problem


def check_exact_part(message, limit: int) -> str:
    return basic_problem(message, limit)[0]

LIMIT = exact.levels(4)


def part(values, weight: float = 1.0, dtype=torch.float32) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(tensor_part=serialize_torch_tensor(torch.tensor(values, dtype=dtype)),
                                       weight=weight)


def test_an_honest_part_passes_codes_checksum_limbs_and_markers_alike():
    q = exact.quantize(torch.randn(3 * exact.BLOCK), 0.25, torch.full((3,), 1e-4, dtype=torch.float64), LIMIT)
    limbs = exact.encode_checksum(exact.checksum(q, 7))
    assert check_exact_part(part(torch.cat([q, limbs, torch.ones(1)])), LIMIT) == ""
    assert check_exact_part(averaging_pb2.AveragingData(weight=1.0), LIMIT) == ""  # a header without a tensor


@pytest.mark.parametrize("message, why", [
    (part([1.0, float("nan")]), "non-finite"),
    (part([1.0, float("inf")]), "non-finite"),
    (part([1.0, 2.5]), "not integers"),
    (part([1.0, float(LIMIT + 1)]), "beyond"),
    (part([1.0, -float(LIMIT) * 100]), "beyond"),
    (part([1.0, 2.0], weight=1e9), "weight"),  # hivemind weighs the mean by what a sender claims
    (part([1.0, 2.0], weight=0.0), "weight"),
    (part([1.0, 2.0], dtype=torch.float64), "dtype"),
    (averaging_pb2.AveragingData(weight=1.0, tensor_part=averaging_pb2.runtime__pb2.Tensor(buffer=b"\x01\x02",
                                                                                         dtype="float32", size=[9])),
     "undecodable"),
])
def test_a_part_no_honest_member_sends_is_named(message, why):
    assert why in check_exact_part(message, LIMIT)


def bare_averager(peer_id="me", passes=None) -> ExactAverager:
    """The hooks' state only: no DHT, no process (what __init__ sets for them)."""
    averager = ExactAverager.__new__(ExactAverager)
    averager._passes, averager.serializer = passes, MSGPackSerializer
    averager._refused, averager._part_checks, averager._bad_senders = PenaltyBox(REFUSE_SECONDS), {}, {}
    averager._senders_seen = {}
    averager.dht = SimpleNamespace(peer_id=peer_id)  # hivemind's peer_id reads it
    averager._parent_pid = None  # no process to stop when it is collected
    return averager


def join(averager: ExactAverager, follower: str, gathered: bytes = b"") -> list:
    class Matchmaking:  # hivemind's, past our hook: accepts everyone
        async def rpc_join_group(self, request, context):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)

    averager._matchmaking = Matchmaking()

    async def run():
        context = SimpleNamespace(remote_id=follower)
        request = averaging_pb2.JoinRequest(gather=gathered)
        return [m.code async for m in averager.rpc_join_group(request, context)]
    return asyncio.run(run())


def test_members_rejected_left_out_or_blamed_are_turned_away_at_matchmaking_for_a_while():
    n = exact.BLOCK
    maxabs = exact.block_maxabs(torch.ones(n)).numpy().tobytes()
    record = dict(name="x", version=1, digest="abcdef", tokens=10, steps=2, budget=5.0, norms=[], maxabs=maxabs,
                  block_norms=maxabs)
    records = [dict(record, peer=p, blame=["evil"] if p in ("me", "b") else []) for p in ("me", "b", "c")]
    records += [dict(record, peer="evil"), dict(record, peer="garbled", tokens="many")]
    island = parse_island(records, Expect(n))
    plan = plan_island(island, "tokens2", 60.0, n)
    # libp2p's authenticated ids: a malformed record's claimed id is never used
    group = SimpleNamespace(peer_ids=["me", "b", "c", "evil-id", "garbled-id"])
    averager = bare_averager()
    averager._refuse_left_out(island, plan, group)
    averager.refuse(frozenset({"slow", "me"}))  # failed our last round (and never ourselves)
    accepted, refused = averaging_pb2.ACCEPTED, averaging_pb2.NOT_LOOKING_FOR_GROUP
    assert [join(averager, p) for p in ("b", "c", "evil-id", "garbled-id", "slow")] == \
        [[accepted], [accepted], [refused], [refused], [refused]]
    averager._refused.until = {p: time.monotonic() - 1 for p in averager._refused.until}  # the while is over
    assert join(averager, "evil-id") == [accepted]


def gathered(record: dict) -> bytes:
    """What hivemind's follower sends: (bandwidth, mode, our record), serialized twice."""
    return MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(record)])


def test_in_a_swarm_with_a_key_only_followers_with_their_own_valid_pass_join_our_group():
    from p2pdiloco.swarm.auth import MemberPasses

    passes, stranger = MemberPasses(b"k" * 32), MemberPasses(b"x" * 32)
    averager = bare_averager(passes=passes)
    accepted, refused = [averaging_pb2.ACCEPTED], [averaging_pb2.NOT_LOOKING_FOR_GROUP]
    assert join(averager, "b", gathered({"pass": passes.of("b")})) == accepted
    assert join(averager, "b", gathered({})) == refused  # no pass
    assert join(averager, "b", gathered({"pass": stranger.of("b")})) == refused  # another key's
    assert join(averager, "c", gathered({"pass": passes.of("b")})) == refused  # b's pass, shown by c
    assert join(averager, "b", b"garbage") == refused
    assert join(bare_averager(), "b", gathered({})) == accepted  # an open swarm asks for none


def test_in_a_swarm_with_a_key_an_island_leaves_out_members_without_a_pass_or_with_anothers_id():
    from p2pdiloco.swarm.auth import MemberPasses

    passes = MemberPasses(b"k" * 32)
    n = exact.BLOCK
    maxabs = exact.block_maxabs(torch.ones(n)).numpy().tobytes()
    base = dict(name="x", version=1, digest="abcdef", tokens=10, steps=2, budget=5.0, norms=[], maxabs=maxabs,
                block_norms=maxabs)
    records = [dict(base, peer="a", **{"pass": passes.of("a")}), dict(base, peer="b"),
               dict(base, peer="c", **{"pass": passes.of("a")}), dict(base, peer="a", **{"pass": passes.of("a")})]
    island = parse_island(records, Expect(n), ["a", "b", "c", "d"], passes.valid)
    assert island.members[0] is not None and island.members[1:] == (None, None, None)
    assert "no valid pass" in island.rejected[1] and "no valid pass" in island.rejected[2]
    assert "another peer's id" in island.rejected[3]  # d claims to be a
    assert parse_island(records[:2], Expect(n), ["a", "b"]).members[1] is not None  # open swarm: no pass needed


def test_in_a_swarm_with_a_key_state_parts_go_only_to_requesters_with_their_own_valid_pass():
    from p2pdiloco.runtime.faults import NO_FAULTS
    from p2pdiloco.swarm.auth import MemberPasses

    passes = MemberPasses(b"k" * 32)
    averager = bare_averager(passes=passes)
    averager.fault_plan = NO_FAULTS

    class Parts:  # the donor's part server, past our hook
        async def serve_part(self, request):
            yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(version=1)))

    averager._part_server = Parts()

    def ask(requester: str, credential) -> dict:
        wanted = dict(version=1, digest="abcdef", start=0, length=10, **({"pass": credential} if credential else {}))
        request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(wanted))

        async def run():
            return [MSGPackSerializer.loads(m.metadata) async for m in
                    averager.rpc_state_part(request, SimpleNamespace(remote_id=requester))]
        return asyncio.run(run())[0]

    assert ask("j", passes.of("j")) == dict(version=1)
    assert "no valid pass" in ask("j", None)["error"]
    assert "no valid pass" in ask("k", passes.of("j"))["error"]  # j's pass, shown by k

    async def whole_state():  # hivemind's download has no room for a pass: refused outright
        return [m async for m in averager.rpc_download_state(averaging_pb2.DownloadRequest(),
                                                             SimpleNamespace(remote_id="j"))]
    assert asyncio.run(whole_state()) == []


def test_parts_under_made_up_group_ids_cannot_grow_what_a_reducer_remembers():
    averager = bare_averager()
    averager._part_checks = {b"ours": ExactPartCheck(LIMIT)}

    async def send(group_id: bytes, values):
        async def stream():
            yield averaging_pb2.AveragingData(group_id=group_id, tensor_part=part(values).tensor_part, weight=1.0)
        try:
            return [m async for m in averager._checked_parts(stream(), SimpleNamespace(remote_id="x"))]
        except ValueError:
            return None

    assert asyncio.run(send(b"ours", [1.0, 2.0])) is not None and "x" in averager._senders_seen[b"ours"]
    assert asyncio.run(send(b"ours", [float("nan")])) is None and averager._bad_senders[b"ours"] == {"x"}
    for i in range(100):
        asyncio.run(send(f"junk{i}".encode(), [float("nan")]))
    assert len(averager._senders_seen) <= 8 and len(averager._bad_senders) <= 8


@pytest.mark.parametrize("fractions", [[0.3, 0.0, 0.7], [0.5, 0.5], [0.2, 0.3, 0.1, 0.4]])
def test_where_each_streamed_part_lies_is_where_hivemind_cut_it(fractions):
    """The claims check needs each message's place in the buffer: `reducer_start` lays the buffer out with
    hivemind's own TensorPartContainer (on meta tensors); here the real one cuts a real buffer, split as the
    averager splits it, and every part a reducer receives sits where we say."""
    from hivemind.averaging.partition import TensorPartContainer

    from p2pdiloco.swarm.averager import AVERAGED_CHUNK
    from p2pdiloco.swarm.partchecks import check_layout, reducer_start

    flat = torch.arange(5 * AVERAGED_CHUNK + 1234, dtype=torch.float32)
    tensors = list(flat.split(AVERAGED_CHUNK))
    sizes = [t.numel() for t in tensors]
    check_layout(sizes)
    container = TensorPartContainer(tensors, fractions)
    for j in range(len(fractions)):
        start, per_part = reducer_start(sizes, fractions, j)
        for k, received in enumerate(container.get_raw_input_parts(j)):
            at = start + k * per_part
            assert torch.equal(received, flat[at:at + received.numel()]), (j, k)
    with pytest.raises(ValueError):
        check_layout([AVERAGED_CHUNK + 1, 10])


def test_a_part_beyond_its_senders_claims_fails_its_stream_even_when_it_came_before_our_plan():
    """hivemind reads a stream's first message before it looks for the group, so it can come before our round
    registered the group's check: it is checked against the claims at the next message, or at the end of the
    stream, still before the round can verify."""
    from p2pdiloco.core.claims import claims_in_codes
    from p2pdiloco.swarm.averager import BadPart

    blocks = 3
    claims = claims_in_codes(torch.ones(blocks), torch.zeros(blocks, dtype=torch.bool), torch.full((blocks,), 3.0),
                             1.0, torch.full((blocks,), 1 / 100, dtype=torch.float64), LIMIT)
    per_part = exact.BLOCK
    check = ExactPartCheck(LIMIT, blocks * exact.BLOCK, 0, per_part, {"x": claims})
    honest = torch.zeros(per_part)
    honest[:5] = 100.0  # at its claimed maximum, within its claimed norm
    lie = torch.full((per_part,), 100.0)  # each value at the maximum: its norm is 43× what it claimed

    def send(values_list, register_after_first: bool):
        averager = bare_averager()
        if not register_after_first:
            averager._part_checks[b"g"] = check

        async def stream():
            for i, values in enumerate(values_list):
                yield averaging_pb2.AveragingData(group_id=b"g", tensor_part=serialize_torch_tensor(values),
                                                  weight=1.0)
                averager._part_checks[b"g"] = check  # our round planned the group meanwhile

        async def run():
            got = []
            try:
                async for m in averager._checked_parts(stream(), SimpleNamespace(remote_id="x")):
                    got.append(m)
            except BadPart as e:
                return len(got), str(e)
            return len(got), ""
        return asyncio.run(run())

    assert send([honest, honest, honest], True) == (3, "")
    assert send([lie, honest], False)[0] == 0  # checked before it is summed
    count, why = send([lie, honest], True)
    assert count == 1 and "norm" in why  # summed, then its stream fails at the next message
    count, why = send([lie], True)
    assert count == 1 and "norm" in why  # or at the end of the stream
