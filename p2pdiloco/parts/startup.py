"""A peer, wired in the order its fork needs, each part built whole and once:
workload → helper processes → θ and Θ → record, merger, DiLoCo → our checkpoint → the join → the stay."""

from __future__ import annotations

import functools
import threading
from typing import Optional

from p2pdiloco.config import PeerConfig
from p2pdiloco.faults.seams import Seams, seams_for
from p2pdiloco.faults.plan import FaultPlan
from p2pdiloco.parts.checkpoints import Checkpoints, checkpoint_folder, resumes_warm
from p2pdiloco.parts.held import SharedState, materialize
from p2pdiloco.parts.helpers import Helpers, announce, start_helpers
from p2pdiloco.parts.membership import Membership
from p2pdiloco.parts.stay import Stay, close_swarm
from p2pdiloco.parts.workload import Workload, member_stream, parking_folder, prepare
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.runtime.metrics import open_sinks
from p2pdiloco.runtime.stopwatch import Stopwatch
from p2pdiloco.swarm import node
from p2pdiloco.swarm.records import Heartbeat
from p2pdiloco.swarm.wiring import build_merger
from p2pdiloco.training.data import stream_seed
from p2pdiloco.training.inner import InnerTrainer
from p2pdiloco.training.ranks import Ranks, ranks_from_env
from p2pdiloco.training.spill import OnDisk


def start(cfg: PeerConfig, stop: threading.Event, since: Optional[float] = None) -> Stay:
    """Everything up to the first inner step; what it started is stopped again should a later part fail. `since`:
    when the start began, if not at this process's start (a supervisor's first life: its supervisor's)."""
    clock = Stopwatch(since)
    clock.mark("imports")
    seams = seams_for(FaultPlan.parse(cfg.swarm.fault_plan))
    warm = resumes_warm(cfg)  # read before the fork: the metadata only
    workload = prepare(cfg)
    clock.mark("workload")
    shared = SharedState()
    helpers = start_helpers(cfg, workload, shared, seams.averager, leaving=stop.is_set)
    ranks = ranks_from_env(workload.device)  # after the helpers' fork: the group's threads stay ours
    clock.mark("helpers")
    merger = metrics = None
    try:
        name = cfg.name or helpers.peer_id[-6:]
        metrics = open_sinks(cfg.metrics_sinks, cfg.log_dir, name, cfg.swarm.run_id,
                             config=dict(model=cfg.model, inner_steps=cfg.inner.steps,
                                         compression=cfg.swarm.compression, mode=cfg.swarm.mode))
        announce(cfg, helpers, name)
        shared.tensors = tensors = materialize(cfg, workload)
        merger = _merger(cfg, workload, helpers, tensors.state, name, stop, seams, ranks.world if ranks else 1)
        diloco = _diloco(cfg, workload, helpers, tensors, merger, name, seams, ranks)
        clock.mark("model")
        checkpoints = Checkpoints(cfg, workload, name, metrics)
        checkpoints.resume(diloco)
        tensors.park()
        clock.mark("checkpoint")
        membership = Membership(cfg, workload, merger, diloco, tensors, metrics, name)
        membership.publish()  # our record tells the restored state from its first beat
        merger.heartbeat.start()
        if merger.pusher is not None:
            merger.pusher.start()
        if warm:  # trains from its checkpoint while it joins
            membership.join_in_background()
        else:
            membership.join_now()
        clock.mark("join")
        return Stay(cfg, stop, workload, helpers, tensors, merger, diloco, membership, checkpoints, metrics, name,
                    clock)
    except BaseException:
        close_swarm(cfg.name or helpers.peer_id[-6:], helpers, merger, metrics)
        raise


def _merger(cfg: PeerConfig, workload: Workload, helpers: Helpers, state, name: str, stop: threading.Event,
            seams: Seams, devices: int):
    record = PeerRecord(peer=helpers.peer_id, name=name, version=state.version, digest=state.digest,
                        merged_by=len(state.last_members),
                        client_mode=cfg.swarm.client_mode, devices=devices, settings=workload.settings(cfg))
    # a peer that sees no other asks its initial peers again: after a restart of the only public one, say
    heartbeat = Heartbeat(helpers.dht, cfg.swarm.run_id, record, helpers.identity,
                          functools.partial(node.rejoin, helpers.dht, cfg.swarm.initial_peers)
                          if cfg.swarm.initial_peers else None)
    return build_merger(helpers.settings, helpers.dht, helpers.averager, heartbeat, state.why_not_adopt, stop,
                        RoundClock(), parking_folder(cfg, workload.n_params), seams.merger)


def _diloco(cfg: PeerConfig, workload: Workload, helpers: Helpers, tensors, merger, name: str, seams: Seams,
            ranks: Optional[Ranks]):
    # our own data order (a restored checkpoint brings back the seed it had, whatever our peer id is now)
    stream = member_stream(cfg, workload, stream_seed(helpers.peer_id, cfg.swarm.run_id), ranks)
    trainer = InnerTrainer(tensors.model, stream, cfg.inner, workload.device, cfg.throttle, ranks,
                           tensors.let_go_of_model)
    # our last merged Δ waits on disk beside our checkpoints: only a lost fork reads it (4 B/param less)
    return seams.diloco(trainer, tensors.state, merger, helpers.peer_id, name, merger.clock,
                        eager=cfg.outer.application == "eager",
                        keep=OnDisk(checkpoint_folder(cfg, name) / "fork-recovery"))
