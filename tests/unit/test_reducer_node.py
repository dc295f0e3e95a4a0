"""A reducer node (`p2pdiloco bootstrap --reduce`), without a network: the island's plan gives it a part to reduce
and no weight, and its part of the exact sum is what any reducer's would be, for members that nobody can dial."""

import asyncio

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import combine_from_streaming

from p2pdiloco.config import OuterConfig, SwarmConfig, merge_rule
from p2pdiloco.core import codec
from p2pdiloco.protocol.island import NO_REDUCER, plan_island
from p2pdiloco.protocol.remote import Expect, parse_island
from p2pdiloco.swarm.codes import CodesExchange, LateError
from p2pdiloco.swarm.reducer import SwarmMergeRule, newer_rule, swarm_rule
from p2pdiloco.swarm.staterelay import HELD_SECONDS, HeldState, push_state, pusher_of, serializer
from p2pdiloco.swarm.wiring import averager_prefix
from tests.unit.test_codes_transport import LoopbackStub, made
from tests.unit.test_island_bounds import N, member


def node(peer: str, **extra) -> dict:
    return dict(peer=peer, name=peer, budget=30.0, **extra)


def planned(records, nodes=frozenset(), clients=frozenset()):
    island = parse_island(records, Expect(N), [r["peer"] for r in records], nodes=frozenset(nodes))
    return island, plan_island(island, "tokens2", 60.0, N, clients=frozenset(clients))


def test_an_island_of_clients_merges_through_a_reducer_node_that_has_no_weight():
    deltas = [torch.randn(N) for _ in range(3)]
    trainers = [member(f"c{i}", d) for i, d in enumerate(deltas)]
    _, alone = planned(trainers, clients={0, 1, 2})
    assert alone.weights is None and alone.reason == NO_REDUCER
    island, plan = planned([*trainers[:2], node("z"), trainers[2]], nodes={2}, clients={0, 1, 3})
    assert island.rejected == ("", "", "", "") and island.members[2] is None and island.nodes[2].peer == "z"
    assert plan.included == [0, 1, 3] and plan.weights[2] == 0.0 and plan.reducers == [2]
    # the node changes nobody's weight: the contributors' are those of the same island without it
    _, public = planned(trainers)
    assert [plan.weights[i] for i in (0, 1, 3)] == public.weights


def test_a_public_member_and_a_reducer_node_share_the_parts_and_one_contributor_is_no_island():
    deltas = [torch.randn(N) for _ in range(2)]
    _, plan = planned([member("p", deltas[0]), node("z"), member("c", deltas[1])], nodes={1}, clients={2})
    assert plan.reducers == [0, 1] and plan.included == [0, 2]
    _, one = planned([member("c", deltas[0]), node("z")], nodes={1}, clients={0})
    assert one.weights is None and "nothing to merge" in one.reason


def test_a_reducer_node_blamed_by_a_contributor_reduces_no_part_unless_no_other_can():
    deltas = [torch.randn(N) for _ in range(3)]
    blamer = dict(member("c0", deltas[0]), blame=["z"])
    _, plan = planned([blamer, member("p", deltas[1]), node("z")], nodes={2}, clients={0})
    assert plan.reducers == [1] and "blamed by c0" in plan.relieved[2]
    _, only = planned([blamer, member("c1", deltas[1]), node("z"), node("y")], nodes={2, 3}, clients={0, 1})
    assert only.reducers == [3]  # the other node takes every part
    _, last = planned([blamer, member("c1", deltas[1]), node("z")], nodes={2}, clients={0, 1})
    assert last.reducers == [2]  # blamed, but nobody else can: the round is tried, and checked as always


@pytest.mark.parametrize("record, why", [
    (dict(node("z"), tokens=10 ** 6), "unknown fields"),  # a node claims no contribution
    (dict(node("z"), peer="someone else"), "another peer's id"),
    (dict(node("z"), blame="everyone"), "blame must be a list"),
    ({"peer": "z", "name": "z"}, "missing fields"),
])
def test_a_malformed_reducer_node_record_is_rejected_with_its_reason(record, why):
    records = [member("c0", torch.randn(N)), member("c1", torch.randn(N)), record]
    island = parse_island(records, Expect(N), ["c0", "c1", "z"], nodes=frozenset({2}))
    assert why in island.rejected[2] and 2 not in island.nodes
    plan = plan_island(island, "tokens2", 60.0, N, clients=frozenset({0, 1}))
    assert plan.weights is None and plan.reason == NO_REDUCER


def exchange_through(reducers, n=3 * codec.BLOCK, fetch_from_node=True):
    """Clients a, b, c push to and fetch from `reducers` (node z among them); z reduces and sends nothing."""
    fmt = codec.DenseFormat(4, 3)
    ex = {name: CodesExchange(max_payload=1 << 20) for name in "abcz"}
    codes = {name: torch.randint(-7, 8, (n,), generator=torch.Generator().manual_seed(i)) for i, name in enumerate("abc")}
    selected = torch.ones(n, dtype=torch.bool)

    def stub_of(me):
        def stub(peer):
            assert peer in reducers, f"{me} dialled {peer}, which reduces nothing"
            return LoopbackStub(ex[peer], me)
        return stub

    async def everyone():
        members = [ex[me].run(b"g", list("abc"), reducers, me, made(codes[me], selected), fmt, stub_of(me),
                              timeout=3.0) for me in ("abc" if fetch_from_node else "ab")]
        reduced = ex["z"].reduce_only(b"g", list("abc"), reducers, "z", n, fmt, 2.0)
        return await asyncio.gather(reduced, *members, return_exceptions=True)

    return asyncio.run(everyone()), codes, ex


def test_clients_get_the_exact_sum_through_a_reducer_node_which_keeps_nothing_once_served():
    (dropped, *results), codes, ex = exchange_through(["z"])
    assert dropped == {}
    for r in results:
        assert torch.equal(torch.cat(r.sums).to(torch.int64), codes["a"] + codes["b"] + codes["c"])
    (reduction,) = ex["z"].reductions.values()
    assert reduction.released and all(p.result is None and not p.payloads for p in reduction.pieces.values())
    assert reduction.held == 0 < reduction.peak_held  # what it held for the round, counted back to nothing
    (_, *shared), codes, _ = exchange_through(["a", "z"])  # a public member takes the first part, z the second
    assert all(torch.equal(torch.cat(r.sums).to(torch.int64), codes["a"] + codes["b"] + codes["c"]) for r in shared)


def test_a_reducer_node_whose_sum_a_member_never_fetched_says_it_was_late():
    (outcome, *_), _, _ = exchange_through(["z"], fetch_from_node=False)  # c never pushes nor fetches
    assert isinstance(outcome, LateError)


def test_a_reducer_node_finds_the_swarms_islands_from_what_its_peers_publish():
    from p2pdiloco.protocol.remote import PeerRecord

    swarm, outer = SwarmConfig(run_id="r", compression="int4", topk=0.05), OuterConfig(max_influence_ratio=1.25)
    settings = dict(parameters=str(N), norms="0", **merge_rule(swarm, outer))
    rule = SwarmMergeRule.of("r", settings)
    assert rule.prefix == averager_prefix(swarm, outer)  # the very key its peers look for groups under
    assert (rule.n, rule.bits, rule.topk, rule.bounds.influence_ratio) == (N, 4, 0.05, 1.25)
    records = [PeerRecord(peer=p, name=p, version=0, digest="abcdef", settings=s)
               for p, s in (("a", settings), ("b", settings), ("c", {**settings, "compression": "int8"}),
                            ("d", {}), ("e", {**settings, "parameters": "many"}),
                            *((f"liar{i}", {**settings, "parameters": str(1 << 60)}) for i in range(3)))]
    assert swarm_rule("r", records) == rule  # the most common readable rule; unreadable ones are skipped, and a
    # size no model has (it would cost the node a view per MB of it), however many records claim it
    assert swarm_rule("r", records[3:]) is None


def test_a_reducer_node_follows_the_rule_most_live_trainers_publish_and_keeps_its_own_on_a_tie():
    """Found running the image by hand: a node that met trainers of `--compression none` first kept reducing by
    their rule after they had gone, and the int4 trainers that came next never found a group."""
    from p2pdiloco.protocol.remote import PeerRecord

    def settings(compression):
        return dict(parameters=str(N), norms="0", **merge_rule(SwarmConfig(run_id="r", compression=compression),
                                                                OuterConfig()))

    def records(*compressions):
        return [PeerRecord(peer=f"p{i}", name=f"p{i}", version=0, digest="abcdef", settings=settings(c))
                for i, c in enumerate(compressions)]

    old, new = (SwarmMergeRule.of("r", settings(c)) for c in ("none", "int4"))
    assert newer_rule("r", records("int4", "int4"), old) == new  # the first trainers have gone
    assert newer_rule("r", records("int4", "int4", "none"), old) == new
    assert newer_rule("r", records("int4", "none"), old) is None  # a tie: it keeps the rule it has
    assert newer_rule("r", records("none", "int4", "none"), old) is None
    assert newer_rule("r", [], old) is None  # nobody publishes: nothing to go by
    assert newer_rule("r", records("int4"), new) is None


class PushStub:
    """A reducer node's rpc_state_push, as a holder's stub calls it, in one process."""

    def __init__(self, held, caller="holder"):
        self.held, self.caller = held, caller

    async def rpc_state_push(self, messages):
        error = await self.held.receive(messages, self.caller)

        async def answer():
            yield averaging_pb2.DownloadData(metadata=serializer.dumps(dict(error=error)) if error else b"")
        return answer()


def served(held, key, start, length):
    async def parts():
        request = averaging_pb2.DownloadData(metadata=serializer.dumps(dict(
            version=key[0], digest=key[1], start=start, length=length)))
        return [m async for m in held.serve_part(request)]
    messages = asyncio.run(parts())
    first = serializer.loads(messages[0].metadata)
    if "error" in first:
        return first["error"]
    return first, deserialize_torch_tensor(combine_from_streaming([m.tensor_part for m in messages]))


def test_a_reducer_node_holds_a_pushed_state_and_serves_its_parts_like_a_donor(monkeypatch):
    from p2pdiloco.core.state import digest
    from p2pdiloco.swarm import staterelay

    monkeypatch.setattr(staterelay, "MAX_PART", 1000)  # several parts, one of them short
    n = 1700
    theta, momentum = torch.randn(n), torch.randn(n)
    key = (5, digest(theta, momentum))
    held = HeldState(n)
    assert served(held, key, 0, 10).startswith("this reducer node does not hold state v5")
    assert asyncio.run(push_state(PushStub(held), dict(version=5, digest=key[1], tokens=7), [theta, momentum])) == ""
    metadata, part = served(held, key, n - 5, 10)  # across Θ and the momentum, as a donor serves it
    assert metadata["tokens"] == 7 and torch.equal(part, torch.cat([theta[-5:], momentum[:5]]))
    assert served(held, (5, "other"), 0, 10).startswith("this reducer node does not hold")
    # an older state is not taken over a newer one; the same one again is fine
    assert "newer" in asyncio.run(push_state(PushStub(held), dict(version=4, digest="x" * 8), [theta, momentum]))
    assert asyncio.run(push_state(PushStub(held), dict(version=5, digest=key[1]), [theta, momentum])) == ""


def test_a_reducer_node_drops_the_state_it_holds_as_a_newer_one_is_pushed_so_it_never_holds_two():
    n = 1700
    held = HeldState(n)
    state = [torch.zeros(n), torch.ones(n)]
    assert asyncio.run(push_state(PushStub(held), dict(version=1, digest="a" * 8), state)) == ""
    seen = []

    class Watching(PushStub):  # what the node holds once the newer push's first part has come
        async def rpc_state_push(self, messages):
            async def watched():
                async for i, m in _numbered(messages):
                    if i == 1:  # the first part: the header was read
                        seen.append(held.flat)
                    yield m
            return await super().rpc_state_push(watched())

    assert asyncio.run(push_state(Watching(held), dict(version=2, digest="b" * 8), state)) == ""
    assert seen == [None] and held.key == (2, "b" * 8)


async def _numbered(messages):
    i = 0
    async for m in messages:
        yield i, m
        i += 1


@pytest.mark.parametrize("tensors, why", [
    ([torch.randn(1700), torch.randn(1699)], "incomplete"),
    ([torch.randn(1700), torch.randn(1701)], "wrong size"),
    ([torch.full((1700,), float("nan")), torch.randn(1700)], "not finite"),
])
def test_a_reducer_node_refuses_a_push_that_is_not_a_whole_finite_state(monkeypatch, tensors, why):
    from p2pdiloco.swarm import staterelay

    monkeypatch.setattr(staterelay, "MAX_PART", 1000)
    held = HeldState(1700)
    error = asyncio.run(push_state(PushStub(held), dict(version=1, digest="d" * 8), tensors))
    assert why in error and held.key is None


def test_a_held_state_goes_once_nobody_asked_for_it_for_a_while_and_a_swarm_key_is_checked():
    now = [0.0]
    held = HeldState(10, admit=lambda peer, token: token == b"ok", clock=lambda: now[0])
    state = [torch.zeros(10), torch.zeros(10)]
    assert "no valid pass" in asyncio.run(push_state(PushStub(held), dict(version=1, digest="d" * 8), state))
    assert asyncio.run(push_state(PushStub(held), dict(version=1, digest="d" * 8), state, b"ok")) == ""
    now[0] = HELD_SECONDS + 1
    assert "does not hold" in served(held, (1, "d" * 8), 0, 5) and held.metadata is None


def test_one_holder_pushes_a_wanted_state_the_first_by_peer_id():
    from p2pdiloco.protocol.remote import PeerRecord

    records = [PeerRecord(peer=p, name=p, version=v, digest=d) for p, v, d in
               (("b", 3, "abcdef"), ("a", 3, "abcdef"), ("c", 2, "fedcba"))]
    assert pusher_of(records, (3, "abcdef")) == "a" and pusher_of(records, (2, "fedcba")) == "c"
    assert pusher_of(records, (4, "abcdef")) is None


def test_a_reducer_node_that_dies_mid_round_fails_the_round_for_every_member_alike():
    """The node serves its first piece's sum and dies: no member may commit what it has, and every one blames the
    node (each member's round raises, so each rolls back and keeps its Δ for the next)."""
    from p2pdiloco.swarm.codes import PIECE, CodesError
    from tests.unit.test_codes_transport import DiesAfterOnePiece

    n, fmt = 3 * PIECE, codec.DenseFormat(4, 2)
    ex = {name: CodesExchange(max_payload=1 << 22) for name in "abz"}
    codes = {name: torch.randint(-7, 8, (n,), generator=torch.Generator().manual_seed(i)) for i, name in enumerate("ab")}
    selected = torch.ones(n, dtype=torch.bool)

    async def round_():
        members = [ex[me].run(b"g", ["a", "b"], ["z"], me, made(codes[me], selected), fmt,
                              lambda peer, me=me: DiesAfterOnePiece(ex[peer], me), timeout=2.0) for me in "ab"]
        node = ex["z"].reduce_only(b"g", ["a", "b"], ["z"], "z", n, fmt, 1.5)
        return await asyncio.gather(node, *members, return_exceptions=True)

    node, *members = asyncio.run(round_())
    assert all(isinstance(m, CodesError) and "z" in m.culprits for m in members), members


def test_a_reducer_node_that_serves_more_than_its_senders_could_send_is_refused_and_blamed_by_every_member():
    """The node is held to its senders' claims like any reducer: it serves 20× the sum (clamped to the sum's
    width); every member finds it beyond what the senders claimed, rolls back and names the node."""
    from p2pdiloco.swarm.codes import CodesError
    from tests.unit.test_codes_transport import LoopbackStub, claimed_codes, forging

    n, fmt = 4 * codec.BLOCK, codec.DenseFormat(4, 2)
    codes, claims = claimed_codes("ab", n, seed=7)
    selected = torch.ones(n, dtype=torch.bool)

    Forging = forging(fmt, n, limit=15)  # the node's part is the whole vector, one piece

    def run_round(stub):
        ex = {name: CodesExchange(max_payload=1 << 20) for name in "abz"}

        async def everyone():
            members = [ex[me].run(b"g", ["a", "b"], ["z"], me, made(codes[me], selected), fmt,
                                  lambda peer, me=me: stub(ex[peer], me), timeout=3.0, claims=claims) for me in "ab"]
            node = ex["z"].reduce_only(b"g", ["a", "b"], ["z"], "z", n, fmt, 2.0, claims)
            return await asyncio.gather(node, *members, return_exceptions=True)
        return asyncio.run(everyone())

    _, *honest = run_round(LoopbackStub)
    assert all(torch.equal(torch.cat(r.sums).to(torch.int64), codes["a"] + codes["b"]) for r in honest)
    _, *forged = run_round(Forging)
    assert all(isinstance(r, CodesError) and r.culprits == frozenset({"z"}) and "beyond" in str(r) for r in forged), \
        forged


@pytest.mark.parametrize("hide", ["own", "nowhere"])
def test_a_reducer_node_that_bends_its_sum_within_the_claims_is_caught_by_its_account(hide):
    """The node serves a sum the claims allow (the members' codes flipped, p2pdiloco.faults.reducer) and hides the
    difference in its own share, or nowhere. A node sends nothing, so its account must hold zero for itself: every
    member refuses the round and names it either way (p2pdiloco.core.audit)."""
    import functools

    from p2pdiloco.faults.reducer import BendingReduction
    from p2pdiloco.swarm.codes import CodesError
    from tests.unit.test_codes_transport import claimed_codes

    n, fmt = 4 * codec.BLOCK, codec.DenseFormat(4, 2)
    codes, claims = claimed_codes("ab", n, seed=7)
    selected = torch.ones(n, dtype=torch.bool)
    ex = {name: CodesExchange(max_payload=1 << 20) for name in "abz"}
    ex["z"].reduction_type = functools.partial(BendingReduction, hide=hide)

    async def everyone():
        members = [ex[me].run(b"g", ["a", "b"], ["z"], me, made(codes[me], selected), fmt,
                              lambda peer, me=me: LoopbackStub(ex[peer], me), timeout=3.0, claims=claims)
                   for me in "ab"]
        node = ex["z"].reduce_only(b"g", ["a", "b"], ["z"], "z", n, fmt, 2.0, claims)
        return await asyncio.gather(node, *members, return_exceptions=True)

    _, *bent = asyncio.run(everyone())
    expected = "its own codes have a norm" if hide == "own" else "do not add up"
    assert all(isinstance(r, CodesError) and r.culprits == frozenset({"z"}) and expected in str(r) for r in bent), bent


def test_a_search_that_found_no_group_is_not_logged_as_an_error_by_any_averager(caplog):
    """Found running the image: every trainer's log held hivemind's traceback for each round that found no group
    (a peer alone does that every round); the round's own line says it. Every averager, a trainer's or a node's,
    installs the filter once as it starts, before it forks its process (which inherits it)."""
    import logging
    from types import SimpleNamespace

    from p2pdiloco.swarm.averager import ExactAverager

    log = logging.getLogger("hivemind.averaging.averager")
    ours = [f for f in log.filters if type(f).__name__ == "_NoGroupIsNews"]
    for f in ours:
        log.removeFilter(f)
    started = []
    host = SimpleNamespace(start=lambda: started.append(len(log.filters)), wait_until_ready=lambda timeout: None)
    ExactAverager.run_in_background(host)
    ExactAverager.run_in_background(host)
    assert sum(type(f).__name__ == "_NoGroupIsNews" for f in log.filters) == 1 and started[0] >= 1
    with caplog.at_level(logging.INFO, logger="hivemind.averaging.averager"):
        log.error("Averaging step failed: could not find a group")
        log.error("something else failed")
    assert [r.getMessage() for r in caplog.records] == ["something else failed"]
