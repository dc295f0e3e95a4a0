"""A restarted peer's join runs in the background while it trains; the training thread takes its result between
two inner steps (p2pdiloco.parts.membership): the state it fetched, or the error that stops the stay."""

import threading
import time
from types import SimpleNamespace

import torch

from p2pdiloco.config import PeerConfig
from p2pdiloco.core.state import GlobalState
from p2pdiloco.parts.membership import Membership
from p2pdiloco.runtime import schema
from p2pdiloco.swarm.node import SwarmConnectError


class Merger:
    def __init__(self, live_others):
        self.stop, self.peer, self.published = threading.Event(), "peer-id", []
        self.live_others = live_others

    def other_wires(self):
        return {}

    def publish_state(self, version, digest, sketch, merged_by=0):
        self.published.append(version)
        self.sketch = sketch


def membership(merger, cfg: PeerConfig = PeerConfig()) -> tuple[Membership, list]:
    written = []
    diloco = SimpleNamespace(state=GlobalState(torch.arange(1000.0), 0.7, 0.9), unmerged_steps=3,
                             trainer=SimpleNamespace(total_steps=12))
    workload = SimpleNamespace(settings=lambda cfg: {})
    metrics = SimpleNamespace(write=written.append)
    return Membership(cfg, workload, merger, diloco, SimpleNamespace(park=lambda: None), metrics, "x"), \
        written


def settle(m: Membership) -> None:
    deadline = time.monotonic() + 10
    while not m.joined and time.monotonic() < deadline:
        m.poll(started=0.0)
        time.sleep(0.01)


def test_a_background_join_that_finds_nobody_ahead_is_taken_between_steps_and_published():
    merger = Merger(live_others=lambda: [])
    m, written = membership(merger)
    m.join_in_background()
    assert not m.joined  # until the training thread polls it
    settle(m)
    assert m.joined and m.error is None and not merger.stop.is_set()
    joined = [r for r in written if isinstance(r, schema.Joined)]
    assert len(joined) == 1 and joined[0].inner_step == 12 and joined[0].unmerged_steps == 3
    assert merger.published == [0]


def test_a_background_join_that_fails_stops_the_stay_and_keeps_the_error_to_raise_once_saved():
    def unreachable():
        raise SwarmConnectError("cannot merge with this swarm: compression differs")

    merger = Merger(live_others=unreachable)
    m, written = membership(merger)
    m.join_in_background()
    settle(m)
    assert isinstance(m.error, SwarmConnectError) and merger.stop.is_set()
    assert not [r for r in written if isinstance(r, schema.Joined)] and merger.published == []


def test_a_peer_of_p_fragments_publishes_a_p_th_of_the_sketch_budget_for_each():
    """Each fragment's sketch rides in the peer's one record, which every store and fetch carries whole: eight
    sketches of 64 values were two thirds of a record of 8 fragments (2.9 KB; docs/fragments.md)."""
    import dataclasses

    from p2pdiloco.core.consensus import SKETCH_DIM, sketch

    for fragments, values in ((1, SKETCH_DIM), (4, SKETCH_DIM // 4), (8, 8), (32, 8)):
        merger = Merger(live_others=lambda: [])
        cfg = PeerConfig()
        m, _ = membership(merger, dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, fragments=fragments)))
        m.publish()
        assert merger.sketch == sketch(torch.arange(1000.0), values), fragments
