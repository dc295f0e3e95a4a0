"""Our place in the swarm: joining it (refuse a mismatch, fetch its state if it is ahead), catching up, and
publishing our state after every change. A restarted peer joins in the background while it trains from its
checkpoint; the training thread polls that one join between inner steps (`poll`)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Optional

from p2pdiloco.config import PeerConfig
from p2pdiloco.core.consensus import sketch, sketch_dim
from p2pdiloco.parts.held import Tensors
from p2pdiloco.parts.workload import Workload
from p2pdiloco.protocol.compat import mismatch, wire_mismatch
from p2pdiloco.runtime import schema
from p2pdiloco.swarm.node import SwarmConnectError
from p2pdiloco.swarm.rounds import SwarmMerger
from p2pdiloco.training.diloco import DiLoCo

log = logging.getLogger("p2pdiloco")
STATE_DOWNLOAD_TIMEOUT = 60.0
JOIN_WAIT_ON_LEAVE = 3.0  # leaving during a warm start's background join: how long it may finish


class Membership:
    def __init__(self, cfg: PeerConfig, workload: Workload, merger: SwarmMerger, diloco: DiLoCo, tensors: Tensors,
                 metrics, name: str):
        self.cfg, self.workload, self.merger, self.diloco, self.tensors = cfg, workload, merger, diloco, tensors
        self.metrics, self.name = metrics, name
        self.own_sketch: list[float] = []  # of our state as last published
        self.pending: Optional[Future] = None  # a warm start's join, under way in the background
        self.error: Optional[BaseException] = None  # why that join failed (raised once the stay is saved)

    @property
    def state(self):
        return self.diloco.state

    # ---- joining ----------------------------------------------------------------------------------------
    def join_now(self) -> None:
        """Cold start: the checks, then the swarm's state if it is ahead of ours, before training."""
        if self.cfg.swarm.initial_peers:
            self.refuse_a_mismatch()
            self.resync("joining")
        self.publish()

    def join_in_background(self) -> None:
        """Warm start: the same, in a daemon thread (leaving must not wait for it; the lifeline takes the helpers
        down); the state it fetched is adopted between inner steps, by `poll`."""
        self.pending = Future()
        threading.Thread(target=self._join_in_background, name="join", daemon=True).start()

    def _join_in_background(self) -> None:
        try:
            self.refuse_a_mismatch()
            loaded = None
            if not self.merger.stop.is_set() and self.swarm_is_ahead():
                loaded = self.merger.download(self.state.version + 1, "joining", timeout=STATE_DOWNLOAD_TIMEOUT)
            self.pending.set_result(loaded)
        except BaseException as e:  # reported by the training thread, which leaves in order
            self.pending.set_exception(e)

    def poll(self, started: float) -> None:
        """Training thread, between inner steps (no round in flight yet: we do not contribute before)."""
        if self.pending is None or not self.pending.done():
            return
        pending, self.pending = self.pending, None
        self.error = pending.exception()
        if self.error is not None:
            log.error("%s: could not join the swarm: %s; saving and leaving", self.name, self.error)
            self.merger.stop.set()
            return
        self.metrics.write(schema.Joined(peer=self.name, peer_id=self.merger.peer,
                                         inner_step=self.diloco.trainer.total_steps,
                                         unmerged_steps=self.diloco.unmerged_steps,
                                         seconds=time.monotonic() - started))
        loaded = pending.result()
        if loaded is not None:
            self.adopt(loaded, "joining")
        else:  # nobody ahead of us, or no state came: a fork at our version is settled at our first round
            log.info("%s: going on from version %d", self.name, self.state.version)
        self.publish()

    @property
    def joined(self) -> bool:
        return self.pending is None

    def wait_on_leave(self) -> None:
        if self.pending is not None and not self.pending.done():  # let the join finish; the lifeline undoes it
            try:
                self.pending.exception(timeout=JOIN_WAIT_ON_LEAVE)
            except TimeoutError:
                log.warning("%s: still connecting; leaving it to the lifeline", self.name)

    def refuse_a_mismatch(self) -> None:
        """A setting that cannot merge with the live peers' ends this peer now, saying which."""
        live = self.merger.live_others()
        why = wire_mismatch(self.merger.other_wires(), len(live)) or mismatch(self.workload.settings(self.cfg), live)
        if why is not None:
            raise SwarmConnectError(f"cannot merge with this swarm: {why}")

    # ---- catching up ------------------------------------------------------------------------------------
    def resync(self, why: str) -> bool:
        """Download the newest global state from live peers (validated: never trust the network)."""
        if not self.swarm_is_ahead():
            log.info("%s: no live peer is ahead of version %d: starting from it", self.name, self.state.version)
            return False
        loaded = self.merger.download(self.state.version + 1, why, timeout=STATE_DOWNLOAD_TIMEOUT)
        if loaded is None:
            log.warning("%s: could not download the swarm's state (%s); going on from version %d", self.name,
                        why, self.state.version)
            return False
        self.adopt(loaded, why)
        return True

    def swarm_is_ahead(self) -> bool:
        """Only a newer version is worth fetching: a peer restored ahead of the others (they restarted from
        older checkpoints) would otherwise wait out the download deadline for a state nobody has, and one
        at our version with another digest (a fork) is settled by the first round's catch-up rule."""
        return any(r.version > self.state.version for r in self.merger.live_others())

    def adopt(self, loaded, why: str) -> None:
        self.diloco.adopt(*loaded)
        log.info("%s: resynced (%s) to version %d", self.name, why, self.state.version)
        self.metrics.write(schema.Resync(peer=self.name, why=why, version=self.state.version,
                                         digest=self.state.digest))
        self.tensors.park()

    def publish(self) -> None:
        """After every round and every change of Θ: our version, digest and sketch in our record."""
        self.own_sketch = sketch(self.state.params, sketch_dim(self.cfg.swarm.fragments), let_go=self.state.let_go)
        self.merger.publish_state(self.state.version, self.state.digest, self.own_sketch, len(self.state.last_members))
