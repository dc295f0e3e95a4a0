"""A started peer's stay: train (rounds merge in the background), report, save, leave within a bound."""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import torch

from p2pdiloco.config import PeerConfig
from p2pdiloco.parts.checkpoints import Checkpoints
from p2pdiloco.parts.held import Tensors
from p2pdiloco.parts.helpers import Helpers
from p2pdiloco.parts.membership import Membership
from p2pdiloco.parts.roundlog import RoundLog
from p2pdiloco.parts.workload import Workload
from p2pdiloco.protocol.outcomes import Contribution
from p2pdiloco.runtime import schema
from p2pdiloco.runtime.stopwatch import Stopwatch
from p2pdiloco.swarm import node
from p2pdiloco.swarm.rounds import SwarmMerger
from p2pdiloco.training import checkpoint
from p2pdiloco.training.diloco import DiLoCo, Settled, train
from p2pdiloco.training.inner import evaluate

log = logging.getLogger("p2pdiloco")
# Leaving on SIGTERM/Ctrl-C has a 10 s bound in all: the round in flight, a checkpoint, the final
# evaluation and stopping the helpers must fit, also on a slow, loaded machine.
LEAVE_ROUND_WAIT = 4.0  # a round already exchanging tensors may finish (one still matchmaking is cancelled)
LEAVE_STOP_WAIT = 2.5  # the averager leaving its groups, side by side with withdrawing our record
FINISH_ROUND_WAIT = 120.0  # at max rounds/time: let the last round finish


class Stay:
    def __init__(self, cfg: PeerConfig, stop: threading.Event, workload: Workload, helpers: Helpers,
                 tensors: Tensors, merger: SwarmMerger, diloco: DiLoCo, membership: Membership,
                 checkpoints: Checkpoints, metrics, name: str, startup: Stopwatch):
        self.cfg, self.stop, self.workload, self.helpers, self.tensors = cfg, stop, workload, helpers, tensors
        self.merger, self.diloco, self.membership, self.checkpoints = merger, diloco, membership, checkpoints
        self.metrics, self.name, self.startup = metrics, name, startup
        self.log = RoundLog(name, workload, diloco, merger.heartbeat, metrics, cfg.inner.steps)
        self.leave_error: Optional[BaseException] = None  # what this stay trained could not be saved

    # ---- training ---------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg
        # with evaluations off (chaos runs, benchmarks) a (re)starting peer goes straight to training
        initial_val = self._evaluate_global() if cfg.eval_every else None
        self.tensors.park()
        self.startup.mark("evaluation")
        self.log.start(initial_val, self.workload.data.description, cfg.swarm.mode, self.startup.seconds)
        train(self.diloco, cfg.inner.steps, self._should_leave, self._on_step, self._on_round,
              synchronous=cfg.swarm.mode == "sync", round_seconds=cfg.inner.round_seconds,
              final_wait=self._round_wait_on_leaving, on_contribute=self._on_contribute,
              ready=lambda: self.membership.joined)
        if cfg.checkpoint_every or self.checkpoints.timed:
            self.checkpoints.save(self.diloco, "leaving", wait=True)
            if self.checkpoints.error:  # said once more, on exit: what this stay trained was not saved
                self.leave_error = checkpoint.CheckpointWriteError(self.checkpoints.error)
        self.diloco.trainer.release_ranks()  # after the save: a rank that died meanwhile cannot cost it
        summary = self.log.summary(initial_val, self._evaluate_global(), self.workload.device)
        if self.membership.error is not None:
            raise self.membership.error  # after the work of this stay was checkpointed
        if self.leave_error is not None:
            raise self.leave_error  # after the summary: a run that could not save ends non-zero
        return summary.to_dict()

    def _evaluate_global(self) -> float:
        """Validation loss of Θ, the global model every peer converges to (θ, the local one, runs ahead)."""
        state = self.diloco.state
        return evaluate(self.tensors.model, self.workload.val, self._theta_device, params=state.params,
                        let_go=state.let_go)  # no second model

    @property
    def _theta_device(self) -> torch.device:
        """Where the model whose modules evaluate Θ lives (with --fsdp, rank 0's mirror, in host memory)."""
        return next(self.tensors.model.parameters()).device

    def _round_wait_on_leaving(self) -> float:
        """How long the round in flight may still take once training ends. At max rounds/time it may finish.
        Leaving on a signal, a round still looking for an island is cancelled now (its outcome, a rollback,
        comes back at once) and one already exchanging tensors gets LEAVE_ROUND_WAIT."""
        if not self.stop.is_set():
            return FINISH_ROUND_WAIT
        if self.merger.leave_round():
            log.info("%s: leaving: the round still looking for an island is cancelled", self.name)
        return LEAVE_ROUND_WAIT

    def _should_leave(self) -> bool:
        cfg = self.cfg
        leave = (self.stop.is_set() or (cfg.max_rounds is not None and self.log.rounds >= cfg.max_rounds)
                 or (cfg.max_time is not None and time.monotonic() - self.log.started >= cfg.max_time))
        if leave and self.log.training_ended is None:
            self.log.training_ended = time.monotonic()
        return leave

    def _on_step(self, loss: torch.Tensor, seconds: float) -> None:
        self.membership.poll(self.log.started)
        self.log.step(loss, seconds)
        self.checkpoints.collect()
        if self.checkpoints.due():
            self.checkpoints.save(self.diloco, "timed")
            self.tensors.park()  # the save read Θ and the momentum

    def _on_contribute(self, c: Contribution) -> None:
        if self.cfg.checkpoint_every or self.checkpoints.timed:
            self.checkpoints.note_contribution(self.diloco, c)
        self.metrics.write(schema.Contribute(peer=self.name, version=c.version, tokens=c.tokens, steps=c.steps))
        self.tensors.park()

    def _on_round(self, settled: Settled | None) -> None:
        if settled is None:
            return
        self.log.settled(settled)
        self.membership.publish()
        self.checkpoints.note_merged(settled)
        merged, cfg = self.log.merged_rounds, self.cfg
        if settled.applied and cfg.checkpoint_every and merged % cfg.checkpoint_every == 0:
            self.checkpoints.save(self.diloco, "periodic")
        evaluate_now = settled.applied and cfg.eval_every and merged % cfg.eval_every == 0
        self.log.round(settled, self._evaluate_global() if evaluate_now else None, self.membership.own_sketch)
        self.tensors.park()

    # ---- leaving ----------------------------------------------------------------------------------------
    def close(self) -> None:
        self.membership.wait_on_leave()
        self.diloco.close()
        close_swarm(self.name, self.helpers, self.merger, self.metrics)


def close_swarm(name: str, helpers: Optional[Helpers], merger: Optional[SwarmMerger], metrics) -> None:
    """Withdraw our record (others stop waiting for us) and let the averager leave its groups, side by side; then
    the DHT, which both use. The lifeline is left running: once this process exits, it kills any helper that did
    not stop in time. Any part may be missing (a start that failed halfway)."""
    averager = merger.shutdown if merger is not None else helpers and helpers.averager.shutdown
    stop_side_by_side(name, LEAVE_STOP_WAIT, heartbeat=merger and merger.heartbeat.stop, averager=averager)
    stop_side_by_side(name, node.STOP_WAIT + 0.5, dht=helpers and (lambda: node.shutdown(helpers.dht)))
    if metrics is not None:
        metrics.close()


def stop_side_by_side(name: str, budget: float, **stops) -> None:
    """Run each stop in its own daemon thread and wait for them at most `budget` seconds in all."""
    started = time.monotonic()
    threads = {what: threading.Thread(target=stop, name=f"stop-{what}", daemon=True)
               for what, stop in stops.items() if stop}
    for thread in threads.values():
        thread.start()
    for what, thread in threads.items():
        thread.join(max(0.0, started + budget - time.monotonic()))
        if thread.is_alive():
            log.warning("%s: the %s did not stop within %.1f s; leaving it to the lifeline", name, what, budget)
    if threads and time.monotonic() - started > 1.0:  # say what ate into the leave's bound
        log.info("%s: stopping the %s took %.1f s", name, " and ".join(threads), time.monotonic() - started)
