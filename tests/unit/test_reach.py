"""A downloaded state is taken only as far from ours as the versions between explain (p2pdiloco.core.reach): a
member that claims a newer version than it holds cannot hand the swarm a model of its choosing."""

import math
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from p2pdiloco.core.reach import RefusedKeys, versions_apart
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.swarm import rounds
from p2pdiloco.swarm.rounds import SwarmMerger
from tests.harness.merger import fake_merger

N, LR, MU = 4096, 0.7, 0.9


def lineage(seed: int = 0, merges: int = 6):
    """A peer's global state after `merges` rounds of merged updates of norm ~1, each seen as a member would."""
    g = torch.Generator().manual_seed(seed)
    state = GlobalState(torch.randn(N, generator=g), LR, MU)
    for _ in range(merges):
        step(state, g)
    return state, g


def step(state: GlobalState, g: torch.Generator) -> None:
    merged = torch.randn(N, generator=g) / N ** 0.5  # norm ~1
    state.saw_merge(merged)  # as every member of the round does, stale or not
    state.apply(merged, ["a", "b"])


def stranger(seed: int = 99) -> torch.Tensor:
    """A Θ of no lineage of ours, drawn from its own seed: drawn from torch's global generator, a liar's Θ was the
    lineage's starting point whenever a test before had seeded it with 0 (test_fragments does), so near ours."""
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def served(state: GlobalState) -> tuple[dict, list[torch.Tensor]]:
    metadata, tensors = state.snapshot()
    return metadata, tensors


def test_an_honest_state_some_versions_ahead_or_on_a_fork_is_taken():
    ours, g = lineage()
    ahead = GlobalState(ours.params.clone(), LR, MU)
    ahead.load(*served(ours))
    for k in range(1, 4):
        step(ahead, g)
        assert ours.why_not_adopt(*served(ahead), corroborated=False) is None, k
    fork, g2 = GlobalState(ours.params.clone(), LR, MU), torch.Generator().manual_seed(7)
    fork.load(*served(ours))
    step(fork, g2), step(fork, g2)
    step(ours, g), step(ours, g)
    assert versions_apart(ours.history, fork.history) == 4
    assert ours.why_not_adopt(*served(fork), corroborated=False) is None


def test_a_liars_state_is_refused_naming_what_moved_unless_two_donors_serve_it():
    ours, g = lineage()
    liar = GlobalState(ours.params.clone(), LR, MU)
    liar.load(*served(ours))
    step(liar, g)
    liar.params.add_(torch.randn(N, generator=g) * 0.5)  # its merge plus a model of its own: ~30 in norm
    liar.version += 5  # and claims versions it never made
    liar._digest = None
    why = ours.why_not_adopt(*served(liar), corroborated=False)
    assert why is not None and why.startswith("Θ would move") and "served by one peer alone" in why, why
    assert ours.why_not_adopt(*served(liar), corroborated=True) is None  # the swarm moved on while we were away

    momentum_only = GlobalState(ours.params.clone(), LR, MU)
    momentum_only.load(*served(ours))
    step(momentum_only, g)
    momentum_only.outer.momentum_buffer.mul_(1000)
    momentum_only._digest = None
    why = ours.why_not_adopt(*served(momentum_only), corroborated=False)
    assert why is not None and why.startswith("the outer momentum would move"), why


def test_a_peer_that_saw_no_merge_takes_the_state_it_is_given():
    """A joiner has nothing to measure by: it takes the best state, as before."""
    fresh = GlobalState(torch.zeros(N), LR, MU)
    far = GlobalState(torch.randn(N) * 100, LR, MU)
    assert fresh.why_not_adopt(*served(far), corroborated=False) is None


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seen", [1, 3, 200])
def test_honest_moves_fit_the_allowance_even_as_aligned_merges_build_the_momentum_up(k, seen):
    """The worst honest case: every merge the same, from zero momentum, so each step is longer than the last
    (Nesterov's momentum builds up over ~1/(1−μ) steps). Measured on the `seen` merges before, the next k
    versions' move still fits the allowance (k = 3 right after the first merge: 10.3 of 11.4 allowed)."""
    direction = torch.randn(N)
    merged = direction / direction.norm()
    state = GlobalState(torch.zeros(N), LR, MU)
    for _ in range(seen):
        state.saw_merge(merged)
        state.apply(merged, ["a"])
    before = [t.clone() for t in state.outer.state_tensors()]
    for _ in range(k):
        state.apply(merged, ["a"])
    moved = [float((a - b).norm()) for a, b in zip(state.outer.state_tensors(), before)]
    theta, momentum = state.reach.allowance(k)
    assert moved[0] <= theta and moved[1] <= momentum, (moved, theta, momentum)


def test_a_merges_move_is_measured_on_our_own_state_and_leaves_it_untouched():
    state, g = lineage()
    merged = torch.randn(N, generator=g) / N ** 0.5
    before = [t.clone() for t in state.outer.state_tensors()]
    moves = state.outer.moves(merged)
    assert all(torch.equal(a, b) for a, b in zip(state.outer.state_tensors(), before))
    state.apply(merged, ["a"])
    after = state.outer.state_tensors()
    assert moves == pytest.approx([float((a - b).norm()) for a, b in zip(after, before)], rel=1e-5)


def test_refused_keys_expire_and_are_bounded():
    refused = RefusedKeys(seconds=10.0, limit=3)
    for i in range(5):
        refused.refuse((i, "d"), now=float(i))
    assert refused.active(4.0) == {(2, "d"), (3, "d"), (4, "d")}
    assert refused.active(13.5) == {(4, "d")}


def driver(monkeypatch, ours: GlobalState, states: dict, extra=()):
    """SwarmMerger's download loop as it runs, over these peers' records and states (each serves its own)."""
    records = [PeerRecord(peer=name, name=name, version=m["version"], digest=m["digest"])
               for name, (m, _) in states.items()] + list(extra)
    monkeypatch.setattr(rounds, "fetch_reducers", lambda dht, run_id: [])  # no reducer node: see below for one
    fetched = []

    def fetch(donors, key, size, timeout, leaving):
        fetched.append(donors[0])
        metadata, tensors = states[donors[0]]
        return SimpleNamespace(metadata=metadata, flat=torch.cat(tensors), parts_by_donor=Counter({donors[0]: 1}),
                               failed_donors=set(), requeued_parts=0)

    merger = fake_merger(N, fetcher=SimpleNamespace(fetch=fetch), why_not_adopt=ours.why_not_adopt, run_id="r")
    merger.load_state = lambda timeout: pytest.fail("hivemind's one-donor download would pick the liar again")
    merger.fetched = fetched
    # what signs our wants of state (want_state is faked), and the records the merger fetches
    merger.heartbeat = SimpleNamespace(identity="our key", fetch=lambda: records)
    return merger


def test_the_driver_refuses_a_liars_state_blames_it_and_takes_the_honest_one(monkeypatch):
    """One peer claims v20 and serves a state of its own: the download refuses it, blames that donor, forgets its
    record for catch-up, and takes the honest peers' v7 instead (the next-best key)."""
    ours, g = lineage()
    honest = GlobalState(ours.params.clone(), LR, MU)
    honest.load(*served(ours))
    step(honest, g)
    liar = GlobalState(stranger(), LR, MU)
    liar.version = 20
    merger = driver(monkeypatch, ours, {"liar": served(liar), "honest": served(honest)},
                    [PeerRecord(peer="honest2", name="honest2", version=honest.version, digest=honest.digest)])

    loaded = SwarmMerger.download(merger, ours.version + 1, "behind", timeout=5.0)
    assert loaded is not None and loaded[0]["version"] == honest.version
    assert merger.penalties.active(0.0) == ["liar"]
    assert [r.peer for r in merger.live_others()] == ["honest", "honest2"]


def test_in_a_swarm_of_two_the_only_other_peers_state_is_taken_however_far():
    """Nothing tells a liar from the only other peer, which may have merged alone while we were away: a state every
    other live peer serves is taken (the limit of this defence, docs/hostile.md)."""
    ours, _ = lineage()
    far = GlobalState(stranger(), LR, MU)
    far.version = 20
    with pytest.MonkeyPatch.context() as monkeypatch:
        merger = driver(monkeypatch, ours, {"other": served(far)})
        loaded = SwarmMerger.download(merger, ours.version + 1, "behind", timeout=5.0)
    assert loaded is not None and loaded[0]["version"] == 20 and not merger.penalties.active(0.0)


def test_a_stale_member_refusing_the_only_holder_of_the_result_gives_up_at_once(monkeypatch):
    """Stale in an island whose newest member lied, it would wait out the download's deadline for a state only the
    liar holds (seen: 45 s of a round in the swarm test). It stops after the one refusal instead."""
    ours, _ = lineage()
    liar = GlobalState(stranger(), LR, MU)
    liar.version = ours.version + 2
    honest = GlobalState(ours.params.clone(), LR, MU)
    honest.load(*served(ours))
    merger = driver(monkeypatch, ours, {"liar": served(liar), "honest": served(honest)})
    started = time.monotonic()
    assert SwarmMerger.download(merger, liar.version, "stale contribution", timeout=60.0) is None
    assert time.monotonic() - started < 30  # not the deadline's 60 s
    assert merger.fetched == ["liar"] and merger.penalties.active(0.0) == ["liar"]


def test_a_download_whose_only_holder_left_gives_up_once_a_record_would_have_expired(monkeypatch):
    """Two peers behind, the one peer that held the newer state gone (it finished its run), or in client mode: the
    download stops after TTL, not at the deadline (seen on the testbed: minutes of asking each other for it)."""
    ours, _ = lineage()
    other = GlobalState(ours.params.clone(), LR, MU)
    other.load(*served(ours))
    client = PeerRecord(peer="client", name="client", version=ours.version + 2, digest="ff", client_mode=True)
    merger = driver(monkeypatch, ours, {"other": served(other)}, [client])  # holds it, but nobody can dial it
    merger.load_state = lambda timeout: pytest.fail("hivemind's one-donor download could only fetch an older state")
    monkeypatch.setattr(rounds, "TTL", 0.3)
    started = time.monotonic()
    assert SwarmMerger.download(merger, ours.version + 2, "behind", timeout=30.0) is None
    assert time.monotonic() - started < 5  # not the deadline's 30 s


def test_where_only_clients_hold_the_state_it_comes_through_a_reducer_node_once_a_holder_pushed_it(monkeypatch):
    """Two clients hold v+2 and nobody can dial them: the download wants their key from the reducer node, asks
    until the node holds it (a holder pushes it: p2pdiloco.swarm.staterelay), and takes it, vouched for by both."""
    ours, _ = lineage()
    other = GlobalState(ours.params.clone(), LR, MU)
    other.load(*served(ours))
    holders = [PeerRecord(peer=p, name=p, version=ours.version + 2, digest=ours.digest, client_mode=True)
               for p in ("c1", "c2")]
    metadata, tensors = served(other)
    merger = driver(monkeypatch, ours, {"node": ({**metadata, "version": ours.version + 2}, tensors)}, holders)
    monkeypatch.setattr(merger.heartbeat, "fetch", lambda: holders)  # the node publishes no peer record
    monkeypatch.setattr(rounds, "fetch_reducers", lambda dht, run_id: [dict(peer="node", name="vps")])
    monkeypatch.setattr(rounds, "RELAY_RETRY", 0.01)
    wants, fetch = [], merger.fetcher.fetch

    def not_yet_then_served(donors, key, size, timeout, leaving):
        if len(wants) < 3:
            raise RuntimeError("this reducer node does not hold state (yet)")
        return fetch(donors, key, size, timeout, leaving)

    merger.fetcher.fetch = not_yet_then_served
    monkeypatch.setattr(rounds, "want_state", lambda dht, run_id, peer, key, node: wants.append((key, node)))
    loaded = SwarmMerger.download(merger, ours.version + 1, "behind", timeout=30.0)
    assert loaded is not None and loaded[0]["version"] == ours.version + 2
    assert wants[0] == ((ours.version + 2, ours.digest), "node") and merger.fetched == ["node"]


def test_a_state_relayed_through_reducer_nodes_is_asked_of_the_next_node_when_one_never_serves_it(monkeypatch):
    ours, _ = lineage()
    holder = PeerRecord(peer="c1", name="c1", version=ours.version, digest=ours.digest, client_mode=True)
    merger = driver(monkeypatch, ours, {"second": served(ours)}, [holder])  # only the second node ever serves it
    monkeypatch.setattr(merger.heartbeat, "fetch", lambda: [holder])
    monkeypatch.setattr(rounds, "fetch_reducers", lambda dht, run_id: [dict(peer="dead", name="a"),
                                                                        dict(peer="second", name="b")])
    monkeypatch.setattr(rounds, "RELAY_RETRY", 0.01)
    monkeypatch.setattr(rounds, "RELAY_PER_NODE", 0.1)
    wants, fetch = [], merger.fetcher.fetch

    def only_the_second(donors, key, size, timeout, leaving):
        if donors != ["second"]:
            raise RuntimeError("this reducer node does not answer")
        return fetch(donors, key, size, timeout, leaving)

    merger.fetcher.fetch = only_the_second
    monkeypatch.setattr(rounds, "want_state", lambda dht, run_id, peer, key, node: wants.append(node))
    loaded = SwarmMerger.download(merger, ours.version, "joining", timeout=30.0)
    assert loaded is not None and wants[0] == "dead" and wants[-1] == "second"


def test_a_download_waits_for_a_state_a_live_peer_is_still_making(monkeypatch):
    """A peer whose island's all-reduce runs may publish the state asked for: it is waited for, and taken."""
    ours, g = lineage()
    newer = GlobalState(ours.params.clone(), LR, MU)
    newer.load(*served(ours))
    step(newer, g)
    merger = driver(monkeypatch, ours, {"maker": served(newer)})
    making = [PeerRecord(peer="maker", name="maker", version=ours.version, digest=ours.digest, merging=ours.version)]
    published = [PeerRecord(peer="maker", name="maker", version=newer.version, digest=newer.digest)]
    started = time.monotonic()
    monkeypatch.setattr(merger.heartbeat, "fetch", lambda: making if time.monotonic() - started < 1.5
                        else published)
    merger.load_state = lambda timeout: pytest.fail("before it publishes, only older states are around")
    monkeypatch.setattr(rounds, "TTL", 0.3)
    loaded = SwarmMerger.download(merger, newer.version, "stale contribution", timeout=30.0)
    assert loaded is not None and loaded[0]["version"] == newer.version


def test_distances_are_exact_over_many_chunks_and_tell_each_chunk_read():
    from p2pdiloco.core import reach

    n = 2 * reach.DISTANCE_CHUNK + 5
    a, b = torch.zeros(n), torch.zeros(n)
    b[0], b[-1], b[reach.DISTANCE_CHUNK] = 3.0, 4.0, 12.0  # one value in each chunk: √(9 + 16 + 144) = 13
    read = []
    assert reach.distances([a, a], [b, a], let_go=read.append) == [13.0, 0.0]
    assert read[:3] == [slice(0, reach.DISTANCE_CHUNK), slice(reach.DISTANCE_CHUNK, 2 * reach.DISTANCE_CHUNK),
                        slice(2 * reach.DISTANCE_CHUNK, n)]


def test_the_allowance_scales_with_the_versions_apart_up_to_its_cap_and_says_why_it_refuses():
    from p2pdiloco.core.reach import Reach

    r = Reach(slack=2.0, max_versions=3)
    assert r.allowance(1) is None and r.why_not([1e9, 1e9], 1) is None  # nothing seen: nothing to measure by
    r.saw_merge(1.0, 0.5)
    r.saw_merge(2.0, 0.25)
    r.saw_merge(math.inf, 1.0)  # a non-finite move is not learnt
    assert r.allowance(1) == (4.0, 1.0) and r.allowance(2) == (8.0, 2.0)  # slack × versions × the largest moves
    assert r.allowance(7) == r.allowance(None) == (12.0, 3.0)  # no shared history: the cap
    assert r.why_not([4.0, 1.0], 1) is None  # at the limit: taken
    assert r.why_not([4.01, 0.0], 1) == "Θ would move 4.01, more than 4 (1 version(s) apart), served by one peer alone"
    assert r.why_not([0.0, 3.5], None) == ("the outer momentum would move 3.5, more than 3 (no shared history), "
                                           "served by one peer alone")
    assert r.why_not([100.0, 100.0], 1, corroborated=True) is None
    assert r.checks(False) and not r.checks(True) and not Reach().checks(False)


def test_a_state_is_judged_by_the_versions_through_its_own_history():
    """Its history as it sent it, with its own key added where missing: 2 versions past the ancestor we share,
    and our own 1 past it, make 3 apart, which allows 3 merges' moves; read as unrelated (no history), the
    cap's moves."""
    ours, g = lineage()
    theirs = GlobalState(ours.params.clone(), LR, MU)
    theirs.load(*served(ours))
    step(theirs, g)
    step(theirs, g)
    step(ours, g)
    meta, tensors = served(theirs)
    calls = []
    real = ours.reach.why_not
    ours.reach.why_not = lambda moved, apart, corroborated: calls.append((apart, corroborated)) or real(
        moved, apart, corroborated)
    assert ours.why_not_adopt(meta, tensors, corroborated=False) is None
    without_own_key = dict(meta, history=meta["history"][:-1])
    ours.why_not_adopt(without_own_key, tensors, corroborated=False)
    ours.why_not_adopt(dict(meta, history="junk"), tensors, corroborated=False)
    assert calls == [(3, False), (3, False), (None, False)]
    read = []
    ours.let_go = read.append
    ours.why_not_adopt(meta, tensors, corroborated=False)
    assert read  # a parked state lets the pages of Θ and the momentum go as the distance reads them
