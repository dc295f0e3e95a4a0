"""A peer that merges its model as fragments (`--fragments P`, P > 1; docs/fragments.md), wired as `startup`
wires a peer of one fragment, lane by lane: fragment i has its own swarm within the run (swarm.fragments), so its
own averager, heartbeat, merger, membership (join, catch-up, publishing) and round log. One trainer steps for all
of them (training.fragments.Streams); checkpoints hold the whole model (parts.checkpoints)."""

from __future__ import annotations

import functools
import gc
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from p2pdiloco.config import PeerConfig
from p2pdiloco.core.exact import digest
from p2pdiloco.core.fragments import Fragment, Stagger, fragment_overlap, split
from p2pdiloco.core.state import GlobalState
from p2pdiloco.faults.plan import FaultPlan
from p2pdiloco.faults.seams import seams_for
from p2pdiloco.parts.checkpoints import Checkpoints, resumes_warm
from p2pdiloco.parts.held import Tensors, materialize
from p2pdiloco.parts.helpers import announce
from p2pdiloco.parts.membership import Membership
from p2pdiloco.parts.roundlog import RoundLog
from p2pdiloco.parts.stay import FINISH_ROUND_WAIT, LEAVE_ROUND_WAIT, LEAVE_STOP_WAIT, stop_side_by_side
from p2pdiloco.parts.workload import Workload, member_stream, prepare
from p2pdiloco.protocol.outcomes import Contribution
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.runtime import schema
from p2pdiloco.runtime.lifeline import start_lifeline
from p2pdiloco.runtime.metrics import open_sinks
from p2pdiloco.runtime.pace import upload_pace
from p2pdiloco.runtime.stopwatch import Stopwatch
from p2pdiloco.swarm import node
from p2pdiloco.swarm.averager import ExactAverager
from p2pdiloco.swarm.fragments import fragment_config
from p2pdiloco.swarm.records import Heartbeat, LaneBeat
from p2pdiloco.swarm.rounds import SwarmMerger
from p2pdiloco.swarm.wiring import MergeSettings, build_merger, merge_settings, start_averager
from p2pdiloco.training import checkpoint
from p2pdiloco.training.data import stream_seed
from p2pdiloco.training.diloco import Settled
from p2pdiloco.training.fragments import Streams, train_streams
from p2pdiloco.training.inner import InnerTrainer, evaluate


class SharedPart:
    """What fragment i's averager serves a joiner: that fragment's state, once it exists."""

    def __init__(self):
        self.state: Optional[GlobalState] = None

    def __call__(self):
        if self.state is None:
            raise RuntimeError("this peer is still starting: no state to share yet")
        return self.state.snapshot(shared=True)


@dataclass(frozen=True)
class FragmentHelpers:
    """The helper processes: the lifeline, the DHT, and an averager per fragment (each forked before any
    model-sized tensor exists)."""

    lifeline: Optional[subprocess.Popen]
    dht: object  # hivemind.DHT
    averagers: tuple[ExactAverager, ...]
    settings: tuple[MergeSettings, ...]
    identity: object  # p2pdiloco.swarm.signing.Identity: our peer id's key, which signs our records

    @property
    def peer_id(self) -> str:
        return self.settings[0].peer


def start_fragment_helpers(cfg: PeerConfig, workload: Workload, fragments: tuple[Fragment, ...],
                           shares: list[SharedPart], make_averager: Callable[..., ExactAverager],
                           leaving: Callable[[], bool]) -> FragmentHelpers:
    lifeline = start_lifeline()
    gc.collect()  # as parts.helpers: what exists now leaves the collector's generations before the forks
    gc.freeze()
    identity = node.identity_of(cfg.swarm)
    dht = node.start_dht(cfg.swarm, identity, leaving=leaving)
    averagers = []
    try:
        overlap = cfg.swarm.overlap_steps or fragment_overlap(cfg.inner.steps, len(fragments),
                                                             cfg.swarm.fragments_in_flight)
        peer, pace = node.peer_id(dht), upload_pace(cfg.swarm.upload_mbps)  # one cap for all our fragments' rounds
        settings = tuple(merge_settings(fragment_config(cfg.swarm, f.index, len(fragments)), cfg.outer, f.size, [],
                                        overlap, peer, pace) for f in fragments)
        for s, share in zip(settings, shares):
            averagers.append(start_averager(s, dht, share, None, make_averager))
    except BaseException:
        for averager in averagers:
            averager.shutdown()
        node.shutdown(dht)
        raise
    return FragmentHelpers(lifeline, dht, tuple(averagers), settings, identity)


@dataclass(frozen=True)
class Lane:
    """Fragment i's side of the peer: its swarm's merger (with its averager and heartbeat), its membership and
    its round log."""

    merger: SwarmMerger
    membership: Membership
    log: RoundLog


def start_streamed(cfg: PeerConfig, stop: threading.Event, since: Optional[float] = None) -> "StreamedStay":
    """Everything up to the first inner step, in the order `parts.startup.start` follows."""
    clock = Stopwatch(since)
    clock.mark("imports")
    seams = seams_for(FaultPlan.parse(cfg.swarm.fault_plan))
    warm = resumes_warm(cfg)
    workload = prepare(cfg)
    fragments = split(workload.shapes, cfg.swarm.fragments)
    clock.mark("workload")
    shares = [SharedPart() for _ in fragments]
    helpers = start_fragment_helpers(cfg, workload, fragments, shares, seams.averager, stop.is_set)
    clock.mark("helpers")
    mergers: list[SwarmMerger] = []
    metrics = None
    try:
        name = cfg.name or helpers.peer_id[-6:]
        metrics = open_sinks(cfg.metrics_sinks, cfg.log_dir, name, cfg.swarm.run_id,
                             config=dict(model=cfg.model, inner_steps=cfg.inner.steps, fragments=len(fragments),
                                         compression=cfg.swarm.compression, mode=cfg.swarm.mode))
        announce(cfg, helpers, name)
        tensors = materialize(cfg, workload)
        stream = member_stream(cfg, workload, stream_seed(helpers.peer_id, cfg.swarm.run_id), None)
        trainer = InnerTrainer(tensors.model, stream, cfg.inner, workload.device, cfg.throttle)
        merger_for = functools.partial(_merger, helpers, peer_heartbeat(cfg, workload, helpers, name), stop,
                                       seams.merger, mergers)
        # Streams takes tensors.state's two vectors over, laid out fragment by fragment (fragment_states): from here on
        # tensors.state is no state in the model's layout, and nothing on this path reads it (the parts' states are)
        streams = Streams(trainer, tensors.state, merger_for,
                          Stagger(len(fragments), cfg.inner.steps, cfg.swarm.fragments_in_flight), helpers.peer_id,
                          name, eager=cfg.outer.application == "eager")
        for share, part in zip(shares, streams.parts):
            share.state = part.state
        clock.mark("model")
        checkpoints = Checkpoints(cfg, workload, name, metrics)
        checkpoints.resume(streams)
        clock.mark("checkpoint")
        memberships = [Membership(cfg, workload, merger, part, tensors, metrics, name)
                       for merger, part in zip(mergers, streams.parts)]
        for membership in memberships:  # every fragment's fields in the record before it first goes out
            membership.publish()
        mergers[0].heartbeat.start()
        for membership in memberships:  # each fragment from its own swarm's donors
            if warm:
                membership.join_in_background()
            else:
                membership.join_now()
        clock.mark("join")

        def merged_seconds() -> float:  # the peer's goodput numerator: every fragment's share of its steps
            return sum(part.merged_seconds for part in streams.parts)
        lanes = [Lane(merger, membership, RoundLog(name, workload, part, merger.heartbeat, metrics, cfg.inner.steps,
                                                   fragment=i, merged_seconds=merged_seconds))
                 for i, (merger, membership, part) in enumerate(zip(mergers, memberships, streams.parts))]
        return StreamedStay(cfg, stop, workload, tensors, streams, lanes, checkpoints, metrics, name, clock,
                            functools.partial(close_lanes, name, helpers, mergers, metrics))
    except BaseException:
        close_lanes(cfg.name or helpers.peer_id[-6:], helpers, mergers, metrics)
        raise


def peer_heartbeat(cfg: PeerConfig, workload: Workload, helpers: FragmentHelpers, name: str) -> Heartbeat:
    """The peer's one heartbeat, under the run's id, for all its fragments: fragment 0's fields are the record's, the
    others' its `lanes` (each fragment's merger fills its own before the heartbeat starts)."""
    unknown = dict(version=0, digest="unknown")
    record = PeerRecord(peer=helpers.peer_id, name=name, version=0, digest="unknown", settings=workload.settings(cfg),
                        client_mode=cfg.swarm.client_mode, lanes=[unknown] * (len(helpers.settings) - 1))
    rejoin = functools.partial(node.rejoin, helpers.dht, cfg.swarm.initial_peers) if cfg.swarm.initial_peers else None
    return Heartbeat(helpers.dht, cfg.swarm.run_id, record, helpers.identity, rejoin)


def _merger(helpers: FragmentHelpers, beat: Heartbeat, stop: threading.Event, make: Callable[..., SwarmMerger],
            made: list, i: int, clock: RoundClock, state: GlobalState) -> SwarmMerger:
    """Fragment i's merger, on its side of the peer's heartbeat (`made`: every one built so far)."""
    lane = LaneBeat(beat, i)
    lane.note(version=state.version, digest=state.digest, merged_by=len(state.last_members))
    merger = build_merger(helpers.settings[i], helpers.dht, helpers.averagers[i], lane, state.why_not_adopt, stop,
                          clock, None, make)
    made.append(merger)
    return merger


def close_lanes(name: str, helpers: FragmentHelpers, mergers: list[SwarmMerger], metrics) -> None:
    """Every fragment's heartbeat and averager, side by side (those whose merger was never built, alone); then
    the DHT."""
    stops = {}
    for i, averager in enumerate(helpers.averagers):
        if i < len(mergers):
            stops[f"heartbeat {i}"] = mergers[i].heartbeat.stop
            stops[f"averager {i}"] = mergers[i].shutdown
        else:
            stops[f"averager {i}"] = averager.shutdown
    stop_side_by_side(name, LEAVE_STOP_WAIT, **stops)
    stop_side_by_side(name, node.STOP_WAIT + 0.5, dht=lambda: node.shutdown(helpers.dht))
    if metrics is not None:
        metrics.close()


class StreamedStay:
    """`parts.stay.Stay` for fragments: trains, logs each fragment's rounds in its lane, checkpoints the whole
    model, and leaves within the same bounds."""

    def __init__(self, cfg: PeerConfig, stop: threading.Event, workload: Workload, tensors: Tensors,
                 streams: Streams, lanes: list[Lane], checkpoints: Checkpoints, metrics, name: str,
                 startup: Stopwatch, close_swarm: Callable[[], None]):
        self.cfg, self.stop, self.workload, self.tensors, self.streams = cfg, stop, workload, tensors, streams
        self.lanes, self.checkpoints, self.metrics, self.name, self.startup = lanes, checkpoints, metrics, name, startup
        self.close_swarm = close_swarm
        self.first = lanes[0].log  # writes the windows of inner steps, the start and the summary
        self.leave_error: Optional[BaseException] = None
        self.settled_rounds = 0  # of all fragments

    def train(self) -> dict:
        cfg = self.cfg
        initial_val = self._evaluate_global() if cfg.eval_every else None
        self.tensors.park()
        self.startup.mark("evaluation")
        self.first.start(initial_val, self.workload.data.description, cfg.swarm.mode, self.startup.seconds)
        train_streams(self.streams, self._should_leave, self._on_step, self._on_round,
                      final_wait=self._round_wait_on_leaving, on_contribute=self._on_contribute,
                      ready=self._may_contribute, looking=self._others_looking)
        if cfg.checkpoint_every or self.checkpoints.timed:
            self.checkpoints.save(self.streams, "leaving", wait=True)
            if self.checkpoints.error:
                self.leave_error = checkpoint.CheckpointWriteError(self.checkpoints.error)
        theta = self.streams.global_params()
        summary = self.first.summary(initial_val, self._evaluate_global(), self.workload.device,
                                     version=sum(self.streams.versions), digest=digest(theta))
        for lane in self.lanes:
            if lane.membership.error is not None:
                raise lane.membership.error
        if self.leave_error is not None:
            raise self.leave_error
        return summary.to_dict()

    def _may_contribute(self, i: int) -> bool:
        """Once joined; and with --max-rounds, fragment i until it has done them (the others may still need
        rounds: its peers, done with theirs, would not be there to merge another)."""
        done = self.cfg.max_rounds is not None and self.lanes[i].log.rounds >= self.cfg.max_rounds
        return not done and all(lane.membership.joined for lane in self.lanes)

    def _others_looking(self, i: int) -> bool:
        return self.lanes[i].merger.heartbeat.others_looking()

    def _evaluate_global(self) -> float:
        """Validation loss of Θ whole, from the fragments' parts (each at its own version)."""
        return evaluate(self.tensors.model, self.workload.val, next(self.tensors.model.parameters()).device,
                        params=self.streams.global_params())

    def _round_wait_on_leaving(self) -> float:
        if not self.stop.is_set():
            return FINISH_ROUND_WAIT
        for lane in self.lanes:
            lane.merger.leave_round()
        return LEAVE_ROUND_WAIT

    def _should_leave(self) -> bool:
        cfg = self.cfg
        rounds = min(lane.log.rounds for lane in self.lanes)  # --max-rounds: every fragment's
        leave = (self.stop.is_set() or (cfg.max_rounds is not None and rounds >= cfg.max_rounds)
                 or (cfg.max_time is not None and time.monotonic() - self.first.started >= cfg.max_time))
        if leave and self.first.training_ended is None:
            self.first.training_ended = time.monotonic()
        return leave

    def _on_step(self, loss: torch.Tensor, seconds: float) -> None:
        for lane in self.lanes:
            lane.membership.poll(self.first.started)
            lane.log.step(loss, seconds)
        self.checkpoints.collect()
        if self.checkpoints.due():
            self.checkpoints.save(self.streams, "timed")
            self.tensors.park()

    def _on_contribute(self, i: int, c: Contribution) -> None:
        if self.cfg.checkpoint_every or self.checkpoints.timed:
            self.checkpoints.note_contribution(self.streams, c, fragment=i)
        self.metrics.write(schema.Contribute(peer=self.name, version=c.version, tokens=c.tokens, steps=c.steps))

    def _on_round(self, i: int, settled: Optional[Settled]) -> None:
        if settled is None:
            return
        lane, cfg = self.lanes[i], self.cfg
        lane.log.settled(settled)
        lane.membership.publish()
        self.checkpoints.note_merged(settled, fragment=i)
        merged, every = sum(x.log.merged_rounds for x in self.lanes), len(self.lanes)  # a period: P rounds
        if settled.applied and cfg.checkpoint_every and merged % (cfg.checkpoint_every * every) == 0:
            self.checkpoints.save(self.streams, "periodic")
        evaluate_now = settled.applied and cfg.eval_every and merged % (cfg.eval_every * every) == 0
        lane.log.round(settled, self._evaluate_global() if evaluate_now else None, lane.membership.own_sketch)
        # the heap's free pages go back once a period, not after each fragment's round: a trim walks every arena
        # whatever a round freed (0.4 % of the training thread at P = 8), and a fragment's round frees 1/P as much
        self.settled_rounds += 1
        self.tensors.park(give_back=self.settled_rounds % len(self.lanes) == 0)

    def close(self) -> None:
        for lane in self.lanes:
            lane.membership.wait_on_leave()
        self.streams.close()
        self.close_swarm()
