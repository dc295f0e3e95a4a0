"""ExactAverager's hooks on hivemind's RPCs, driven without a network: the members it turns away at matchmaking,
who may fetch its state, and hivemind's reducer RPC, which it does not serve."""

import asyncio
import time
from types import SimpleNamespace

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.core import exact
from p2pdiloco.protocol.island import PenaltyBox, Stragglers, plan_island
from p2pdiloco.protocol.remote import Expect, parse_island
from p2pdiloco.swarm.averager import ExactAverager
from p2pdiloco.swarm.island_rounds import REFUSE_SECONDS
from p2pdiloco.swarm.codes import LATE


def bare_averager(peer_id="me", passes=None) -> ExactAverager:
    """The hooks' state only: no DHT, no process (what __init__ sets for them)."""
    averager = ExactAverager.__new__(ExactAverager)
    averager._passes, averager.serializer = passes, MSGPackSerializer
    averager._refused = PenaltyBox(REFUSE_SECONDS)
    averager._left_out = PenaltyBox(REFUSE_SECONDS)
    averager._stragglers = Stragglers()
    averager.dht = SimpleNamespace(peer_id=peer_id)  # hivemind's peer_id reads it
    averager._parent_pid = None  # no process to stop when it is collected
    averager.join_linger = 0.0  # the join stream's wait after its last message: its own test below
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


def test_a_leader_keeps_a_join_stream_open_after_its_last_message():
    """The message that tells a follower its group is the stream's last. A leader that closed the stream right after
    it let the libp2p daemon reset the stream under it (the follower never joined; the others waited out the round
    for it as a reducer). The stream now ends only after `join_linger`."""
    averager = bare_averager()
    averager.join_linger = 0.3

    class Matchmaking:  # hivemind's, past our hook
        async def rpc_join_group(self, request, context):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE, group_id=b"g")

    averager._matchmaking = Matchmaking()

    async def follower():
        stream = averager.rpc_join_group(averaging_pb2.JoinRequest(), SimpleNamespace(remote_id="f"))
        codes = [(await stream.__anext__()).code for _ in range(2)]
        started = time.monotonic()
        ended = [m async for m in stream] == []
        return codes, ended, time.monotonic() - started

    codes, ended, waited = asyncio.run(follower())
    assert codes == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE] and ended
    assert 0.25 <= waited < 2.0, waited


def test_a_member_late_once_is_not_blamed_one_late_again_is_and_a_malformed_part_is_at_once():
    """A scaled liar's round in CI: an honest peer's part missed one reducer's cut-off on 2 busy cores; blamed for
    it, it was turned away by both others and merged nothing for the rest of the run."""
    averager = bare_averager()
    assert averager._blame((), {"slow": LATE, "evil": "malformed part: bad length"}) == {"evil"}
    assert averager._blame({"dead-reducer"}, {"slow": LATE}) == {"dead-reducer", "slow"}  # late again
    # a reducer whose sum came late, or whose round ended first, is a late member too (a sparse round in the
    # bandwidth benchmark: one busy peer's sum was late once, and it was left out for the rest of the run)
    assert averager._blame((), {}, {"busy-reducer"}) == frozenset()
    assert averager._blame((), {}, {"busy-reducer"}) == {"busy-reducer"}


def test_stragglers_blame_only_a_member_late_again_within_the_window():
    stragglers = Stragglers(window=600.0)
    assert stragglers.late(["a", "b"], now=0.0) == frozenset()
    assert stragglers.late(["a"], now=100.0) == {"a"}
    assert stragglers.late(["b"], now=650.0) == frozenset()  # b's last lateness, at 0, is past the window
    assert stragglers.late(["a"], now=699.0) == {"a"}  # a's last, at 100, is not
    assert stragglers.late(["a"], now=1300.0) == frozenset()


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
    from p2pdiloco.swarm.auth import MemberPasses

    passes = MemberPasses(b"k" * 32)
    averager = bare_averager(passes=passes)

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


def test_hivemind_reducer_rpc_takes_no_part_from_anyone():
    """Our rounds never use hivemind's all-reduce: a part a stranger streams there is refused unread."""
    averager = bare_averager()
    read = []

    async def stream():
        for values in ([1.0, 2.0], [float("nan")]):
            read.append(values)
            yield averaging_pb2.AveragingData(group_id=b"g", tensor_part=serialize_torch_tensor(torch.tensor(values)),
                                              weight=1.0)

    async def run():
        return [m async for m in averager.rpc_aggregate_part(stream(), SimpleNamespace(remote_id="x"))]

    assert [m.code for m in asyncio.run(run())] == [averaging_pb2.PROTOCOL_VIOLATION] and read == []


def test_a_leader_our_island_left_out_we_do_not_follow():
    """hivemind's matchmaking asks the averager's class for a leader's stub before asking to join its group. For a
    peer our island left out lately (blamed by most of it) the stub declines, as a leader not looking for a group
    would, and hivemind moves on to the next leader (seen in bench_hostile: an honest peer alone in a group the
    blamed liar led merged nothing, and honest peers in two such groups formed islands apart). A peer only we blame
    we still follow (the others still merge it: declining would split us from them); our own RPCs to a declined
    peer are untouched, and everyone else gets hivemind's stub."""
    import inspect

    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.p2p import PeerID, ServicerBase

    from p2pdiloco.swarm.island_rounds import NotFollowing

    # the seam: hivemind (1.1.12) builds its matchmaking with our class, and asks it for the leader's stub
    assert "servicer_type=type(self)" in inspect.getsource(DecentralizedAverager.__init__)
    assert "self._servicer_type.get_stub(self._p2p, leader" in inspect.getsource(Matchmaking._request_join_group)

    n = exact.BLOCK
    maxabs = exact.block_maxabs(torch.ones(n)).numpy().tobytes()
    evil, mine, honest = (str(PeerID(b"\x12\x20" + c * 32)) for c in (b"e", b"m", b"h"))
    record = dict(name="x", version=1, digest="abcdef", tokens=10, steps=2, budget=5.0, norms=[], maxabs=maxabs,
                  block_norms=maxabs)
    records = [dict(record, peer=p, blame=[evil] if p != evil else []) for p in ("me", "b", "c", evil)]
    island = parse_island(records, Expect(n))
    plan = plan_island(island, "tokens2", 60.0, n)
    averager = bare_averager()
    averager._refuse_left_out(island, plan, SimpleNamespace(peer_ids=["me", "b", "c", evil]))  # blamed by all
    averager.refuse([mine])  # failed a round of ours alone: turned away as a follower, still followed as a leader
    saved = ExactAverager._not_to_follow
    ExactAverager._not_to_follow = lambda: averager._left_out.active(time.monotonic())  # as `run` sets it
    try:
        stubs = {p: ExactAverager.get_stub(None, PeerID.from_base58(p), namespace="run") for p in (evil, mine, honest)}
    finally:
        ExactAverager._not_to_follow = saved
    assert isinstance(stubs[evil], NotFollowing)
    hivemind_own = type(ServicerBase.get_stub.__func__(ExactAverager, None, PeerID.from_base58(honest), namespace="run"))
    assert type(stubs[mine]) is hivemind_own and type(stubs[honest]) is hivemind_own

    async def first_answer():
        stream = await stubs[evil].rpc_join_group(averaging_pb2.JoinRequest())
        message = await anext(stream)
        await stream.aclose()
        return message.code
    assert asyncio.run(first_answer()) == averaging_pb2.NOT_LOOKING_FOR_GROUP
    assert stubs[evil].rpc_codes_push.__func__ is stubs[honest].rpc_codes_push.__func__  # our rounds' RPCs: its own
    # where nothing was set (the host process), every stub is hivemind's
    assert type(ExactAverager.get_stub(None, PeerID.from_base58(evil), namespace="run")) is hivemind_own
