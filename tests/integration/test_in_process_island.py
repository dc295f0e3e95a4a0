"""The parity benchmark's learners merge in one process (p2pdiloco.sim.learners); real peers merge over hivemind
(p2pdiloco.swarm.rounds and the averager's streamed sums). Given the same contributions and the same error
feedback, one round must give both the same merged update and so the same Θ, bit for bit: otherwise the benchmark
would measure something no peer runs."""

import dataclasses
import threading

import pytest
import torch

from p2pdiloco.config import OuterConfig, SwarmConfig
from p2pdiloco.core import codec
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.outcomes import Contribution
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.protocol.round import RoundRules
from p2pdiloco.protocol.timing import GracePolicy, RoundClock
from p2pdiloco.sim.learners import Board, IslandMerger, Wire
from p2pdiloco.swarm import node
from p2pdiloco.swarm.records import Heartbeat
from p2pdiloco.swarm.wiring import build_merger, merge_settings, start_averager

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

N = 3 * codec.BLOCK + 1234  # several blocks, the last one short
TRAINED = [(3200, 25), (1280, 20), (2560, 10)]  # tokens, steps: tokens²/steps weighs them unlike tokens


def contributions(theta: GlobalState, peers: list[str]) -> list[Contribution]:
    g = torch.Generator().manual_seed(7)
    deltas = [torch.randn(N, generator=g) * scale for scale in (1e-2, 3e-2, 2e-2)]
    deltas[1][: codec.BLOCK] *= 40  # one member's first block stands out: its maxima are clipped to the median's
    return [Contribution.of(d, tokens=t, steps=s, version=0, peer=p, name=p, digest=theta.digest)
            for d, (t, s), p in zip(deltas, TRAINED, peers)]


def residuals() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(N, generator=g) * 1e-3 for _ in TRAINED]


def merge_all(mergers, cs):
    outcomes = [None] * len(cs)

    def run(i):
        outcomes[i] = mergers[i].merge(cs[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return outcomes


def real_round(theta: GlobalState):
    """Three peers on loopback: DHTs, averagers, heartbeats and mergers built as a peer builds them."""
    # the robust merge off: the in-process learners do not run its direction check (docs/simulator.md), and these
    # members' Δs are independent noise, which it would leave out
    base = SwarmConfig(run_id="same-bits", compression="int4", quorum=3, connect_timeout=20.0, robust_merge=False)
    dhts, parts = [], []
    try:
        for i in range(3):
            initial = tuple(node.visible_addresses(dhts[0])) if dhts else ()
            cfg = dataclasses.replace(base, initial_peers=initial)
            identity = node.identity_of(cfg)
            dht = node.start_dht(cfg, identity)
            dhts.append(dht)
            settings = merge_settings(cfg, OuterConfig(), N, [], 10, node.peer_id(dht))
            averager = start_averager(settings, dht, theta.snapshot, None)
            heartbeat = Heartbeat(dht, cfg.run_id, PeerRecord(settings.peer, f"p{i}", 0, theta.digest), identity).start()
            merger = build_merger(settings, dht, averager, heartbeat, lambda *a: None, threading.Event(),
                                  RoundClock(), None)
            parts.append((heartbeat, merger))
        peers = [m.peer for _, m in parts]
        for (_, merger), r in zip(parts, residuals()):
            merger.feedback.residual = r.clone()
        cs = contributions(theta, peers)
        outcomes = [dataclasses.replace(o, merged=None if o.merged is None else o.merged.clone())
                    for o in merge_all([m for _, m in parts], cs)]  # off the averagers' buffers before they go
        return peers, outcomes, [m.feedback.residual.clone() for _, m in parts]
    finally:
        for heartbeat, merger in parts:
            heartbeat.stop()
            merger.shutdown()
        for dht in dhts:
            node.shutdown(dht)


def in_process_round(theta: GlobalState, peers: list[str], group: list[str]):
    board = Board(Wire.named("int4"), N, group_order=group.index)  # the real group's order: weights sum in it
    rules = RoundRules(mode="decoupled", quorum=3, overlap_steps=10, grace=GracePolicy(floor=5.0, cap=30.0),
                       poll=0.01)
    feedbacks = [codec.ErrorFeedback(residual=r.clone()) for r in residuals()]
    mergers = [IslandMerger(board, p, rules, f, RoundClock()) for p, f in zip(peers, feedbacks)]
    for p in peers:
        board.publish(p, theta)
    outcomes = merge_all(mergers, contributions(theta, peers))
    return outcomes, [f.residual for f in feedbacks]


def test_one_round_in_one_process_gives_real_peers_theta_bit_for_bit():
    torch.manual_seed(0)
    theta = GlobalState(torch.randn(N), lr=0.7, momentum=0.9)
    peers, real, real_residuals = real_round(theta)
    assert all(o.kind == "committed" for o in real), [o.reason for o in real]
    assert len({tuple(round(w, 6) for w in o.weights) for o in real}) == 1
    assert real[0].bounded  # the outlier's block maxima were clipped and its weight cut: the bounds ran too
    ours, our_residuals = in_process_round(theta, peers, [m.peer for m in real[0].members])
    assert all(o.kind == "committed" for o in ours), [o.reason for o in ours]
    by_peer = {m.peer: w for m, w in zip(real[0].members, real[0].weights)}
    assert {m.peer: w for m, w in zip(ours[0].members, ours[0].weights)} == by_peer
    assert len(set(by_peer.values())) == 3  # three different weights: the weighting rule shows
    for r, o in zip(real, ours):
        assert torch.equal(r.merged, o.merged)
    for a, b in zip(real_residuals, our_residuals):  # error feedback recorded the same codes
        assert torch.equal(a, b)
    after = []
    for outcome in (real[0], ours[0]):
        state = GlobalState(theta.params, lr=0.7, momentum=0.9)
        state.apply(outcome.merged, [m.peer for m in outcome.members])
        after.append(state.digest)
    assert after[0] == after[1]
