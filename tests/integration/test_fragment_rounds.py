"""Streaming fragments over hivemind: three peers train one model each and merge it as two fragments, each
fragment in rounds of its own (its own run id: records, islands, averager and donors; swarm.fragments), built by
the wiring a peer uses. Every fragment's members end each round with bit-identical Θ parts, a round carries a
fragment and no more, and a joiner takes each fragment's state (at different versions) from the swarm and
catches up."""

import dataclasses
import threading

import pytest
import torch

from p2pdiloco.config import InnerConfig, OuterConfig, SwarmConfig
from p2pdiloco.core.consensus import sketch
from p2pdiloco.core.fragments import Stagger
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.swarm import node
from p2pdiloco.swarm.fragments import fragment_config
from p2pdiloco.swarm.records import Heartbeat, LaneBeat
from p2pdiloco.swarm.wiring import build_merger, merge_settings, start_averager
from p2pdiloco.training.fragments import Streams, model_fragments
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model
from tests.unit.test_decoupled import random_batches

# slow (17 s): the default suite's budget; tests/integration/test_fragment_peers.py runs fragments' rounds between
# real peers by default. What only this one shows: a joiner taking each fragment's state from its own swarm
pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(400)]

P, H = 2, 4
# the peers train on random bytes, each its own: their pseudo-gradients share no direction, and the direction check
# (on by default since 0a3b74d) leaves such parts out; this test is about fragments' rounds, not about that check
BASE = SwarmConfig(run_id="streams", compression="int4", quorum=3, connect_timeout=20.0, robust_merge=False)


class FragmentPeer:
    """One peer: a DHT and one heartbeat, and per fragment an averager, the fragment's side of the heartbeat and a
    merger (fragment i's swarm), over one trainer whose P fragments are a `Streams`."""

    def __init__(self, index: int, initial: tuple = ()):
        cfg = dataclasses.replace(BASE, initial_peers=initial)
        identity = node.identity_of(cfg)
        self.dht = node.start_dht(cfg, identity)
        self.peer = node.peer_id(self.dht)
        model = build_model("tiny", seed=0)
        sizes = [f.size for f in model_fragments(model, P)]
        self.streams = None  # built once the averagers have forked; they serve its fragments' states
        self.parts = []
        record = PeerRecord(self.peer, f"p{index}", 0, "unknown", lanes=[dict(version=0, digest="unknown")] * (P - 1))
        self.beat = Heartbeat(self.dht, cfg.run_id, record, identity)
        for i, size in enumerate(sizes):
            fcfg = fragment_config(cfg, i, P)
            settings = merge_settings(fcfg, OuterConfig(), size, [], H, self.peer)
            averager = start_averager(settings, self.dht, self._share(i), None)
            self.parts.append((settings, averager, LaneBeat(self.beat, i)))
        trainer = InnerTrainer(model, random_batches(index), InnerConfig(batch_size=4, seq_len=16, warmup_steps=0),
                               torch.device("cpu"))
        state = GlobalState(flat_params(model), lr=0.7, momentum=0.9)
        self.mergers = []
        self.streams = Streams(trainer, state, self._merger, Stagger(P, H), self.peer, f"p{index}")
        for i in range(P):
            self.publish(i)
        self.beat.start()

    def _share(self, i: int):
        def share():
            if self.streams is None:
                raise RuntimeError("still starting")
            return self.streams.parts[i].state.snapshot()
        return share

    def _merger(self, i: int, clock, state):
        settings, averager, heartbeat = self.parts[i]
        merger = build_merger(settings, self.dht, averager, heartbeat, lambda *a: None, threading.Event(), clock,
                              None)
        self.mergers.append(merger)
        return merger

    def publish(self, i: int) -> None:
        state = self.streams.parts[i].state
        self.mergers[i].publish_state(state.version, state.digest, sketch(state.params))

    def close(self) -> None:
        for merger, (_, _, heartbeat) in zip(self.mergers, self.parts):
            heartbeat.stop()
            merger.shutdown()
        node.shutdown(self.dht)


def lockstep(peers: list[FragmentPeer], steps: int) -> list:
    """Every peer steps; each fragment due leaves on every peer at once and is waited for (a round a fragment)."""
    outcomes = []
    for _ in range(steps):
        for peer in peers:
            peer.streams.inner_step()
        for i in peers[0].streams.due():
            for peer in peers:
                peer.streams.contribute(i)
            for peer in peers:
                settled = peer.streams.wait(i, timeout=120)
                outcomes.append((i, settled))
                peer.publish(i)
    return outcomes


def fragment_digests(peers: list[FragmentPeer], i: int) -> set:
    return {(p.streams.parts[i].state.version, p.streams.parts[i].state.digest) for p in peers}


def test_fragments_merge_in_their_own_rounds_bitwise_equal_and_a_joiner_takes_each_from_the_swarm():
    peers = []
    try:
        for index in range(3):
            peers.append(FragmentPeer(index, tuple(node.visible_addresses(peers[0].dht)) if peers else ()))
        sizes = [f.size for f in peers[0].streams.fragments]
        outcomes = lockstep(peers, 6)  # fragment 0 leaves at steps 2 and 6, fragment 1 at step 4
        assert [i for i, _ in outcomes] == [0] * 3 + [1] * 3 + [0] * 3
        for i, settled in outcomes:
            assert settled.outcome.kind == "committed", settled.outcome.reason
            assert len(settled.outcome.members) == 3
            assert settled.outcome.merged.numel() == sizes[i]  # a round carries its fragment, no more
            # the averager's layout is the fragment's: a fp32 butterfly of 3 members would send 2 × 2/3 of it
            assert settled.outcome.allreduce_bytes_model == sizes[i] * 4 * 2 * 2 // 3
        assert [p.streams.versions for p in peers] == [[2, 1]] * 3  # a peer's fragments at different versions
        for i in range(P):
            assert len(fragment_digests(peers, i)) == 1  # every member holds each fragment's Θ bit for bit
        whole = [p.streams.global_params() for p in peers]
        assert all(torch.equal(whole[0], w) for w in whole[1:])

        joiner = FragmentPeer(3, tuple(node.visible_addresses(peers[0].dht)))
        peers.append(joiner)
        for i in range(P):  # each fragment from its own swarm's donors, at the version that swarm is at
            loaded = joiner.mergers[i].download(1, "joining", timeout=60)
            assert loaded is not None, f"fragment {i}: no state came"
            joiner.streams.parts[i].adopt(*loaded)
            joiner.publish(i)
        assert joiner.streams.versions == [2, 1]
        assert torch.equal(joiner.streams.global_params(), whole[0])

        outcomes = lockstep(peers[:3], 2)  # fragment 1's second round, without the joiner
        assert [(i, s.outcome.kind) for i, s in outcomes] == [(1, "committed")] * 3
        loaded = joiner.mergers[1].download(2, "behind", timeout=60)  # it catches up on the fragment it lacks
        joiner.streams.parts[1].adopt(*loaded)
        assert joiner.streams.versions == [2, 2] and len(fragment_digests(peers, 1)) == 1
        assert torch.equal(joiner.streams.global_params(), peers[0].streams.global_params())
    finally:
        for peer in peers:
            peer.streams.close()
            peer.close()
