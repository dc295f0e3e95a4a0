"""What a stay measures and reports: windows of inner steps, every round, and the summary at the end."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from p2pdiloco.core.consensus import consensus_distance, fork_distance, forked_with
from p2pdiloco.parts.workload import Workload
from p2pdiloco.runtime import schema
from p2pdiloco.runtime.metrics import Progress
from p2pdiloco.training.diloco import DiLoCo, Settled

log = logging.getLogger("p2pdiloco")
WINDOW = 10  # inner steps per metrics record


def mean_loss(losses: list[torch.Tensor]) -> float:
    """One host read for many steps' losses (each still on the device)."""
    return float(torch.stack(losses).float().mean()) if losses else 0.0


class RoundLog:
    def __init__(self, name: str, workload: Workload, diloco: DiLoCo, heartbeat, metrics, steps_per_round: int,
                 fragment: Optional[int] = None, merged_seconds: Optional[Callable[[], float]] = None):
        """`fragment`: this log is of one fragment's rounds (--fragments); the windows of inner steps are written
        by fragment 0's alone, and `merged_seconds` (all the fragments') is the peer's goodput numerator."""
        self.name, self.workload, self.diloco, self.heartbeat, self.metrics = name, workload, diloco, heartbeat, metrics
        self.fragment = fragment
        self.merged_seconds = merged_seconds or (lambda: self.diloco.merged_seconds)
        self.windows = not fragment  # None or 0
        label = name if fragment is None else f"{name}/f{fragment}"
        self.progress = Progress(label, steps_per_round, None if self.windows else False)
        self.started = time.monotonic()
        self.training_ended: Optional[float] = None  # leaving (the last round's wait, saving) is not training
        self.rounds = self.merged_rounds = 0
        self.last_island = 1
        self.compute_seconds = 0.0
        self.bytes_sent = 0  # by our averager, over every round of this process
        self.round_losses: list[torch.Tensor] = []
        self.window_losses: list[torch.Tensor] = []
        self.window_started, self.window_seconds = time.monotonic(), 0.0
        self.window_loss = float("nan")

    @property
    def tokens_trained(self) -> int:
        return self.diloco.trainer.total_steps * self.diloco.trainer.tokens_per_step

    def start(self, initial_val: Optional[float], corpus: str, mode: str, startup: dict[str, float]) -> None:
        state = self.diloco.state
        self.metrics.write(schema.Start(peer=self.name, peer_id=self.diloco.peer, n_params=self.workload.n_params,
                                        val_loss=initial_val, val_bpb=self.workload.bpb(initial_val),
                                        version=state.version, corpus=corpus, mode=mode, startup=startup))
        self.progress.start_round(0, state.version)

    def step(self, loss: torch.Tensor, seconds: float) -> None:
        """`loss` stays on the device: on a GPU it is read once per window of steps, never once per step."""
        trainer = self.diloco.trainer
        self.compute_seconds += seconds
        self.window_losses.append(loss)
        self.window_seconds += seconds
        self.round_losses.append(loss)
        rate = len(self.window_losses) * trainer.tokens_per_step / max(time.monotonic() - self.window_started, 1e-9)
        self.progress.step(self.window_loss if trainer.on_gpu else float(loss), rate, island=self.last_island)
        if len(self.window_losses) == WINDOW:
            self.window_loss = mean_loss(self.window_losses)
            if self.windows:
                self.metrics.write(schema.Window(peer=self.name, step=trainer.total_steps, tokens=self.tokens_trained,
                                                 loss=self.window_loss, tokens_per_s=rate,
                                                 step_seconds=self.window_seconds / WINDOW,
                                                 in_flight=self.diloco.in_flight is not None, **self._goodput()))
            self.heartbeat.note(inner_step=trainer.total_steps, tokens_per_s=rate, loss=self.window_loss)
            self.window_losses, self.window_started, self.window_seconds = [], time.monotonic(), 0.0

    def _goodput(self) -> dict:
        """Cumulative over this process's life: inner-step time, and the part of it that reached Θ."""
        return dict(compute_seconds=self.compute_seconds, merged_seconds=self.merged_seconds())

    def settled(self, settled: Settled) -> None:
        self.rounds += 1
        self.merged_rounds += int(settled.applied)
        self.last_island = max(1, len(settled.outcome.members))

    def round(self, settled: Settled, val: Optional[float], own_sketch: list[float]) -> None:
        o, c, state, diloco = settled.outcome, settled.contribution, self.diloco.state, self.diloco
        # the others as of the last heartbeat (never a DHT call on the training thread), and us as we are now
        others = [r for r in self.heartbeat.records() if r.peer != diloco.peer]
        own = (state.version, state.digest, own_sketch)
        others_states = [(r.version, r.digest, r.sketch) for r in others if r.sketch]
        named = [(r.name, (r.version, r.digest, r.sketch)) for r in others if r.sketch]
        versions = [r.version for r in others] + [state.version]
        distance = consensus_distance([*others_states, own])
        wall = time.monotonic() - self.started
        self.metrics.write(schema.Round(
            **o.record(), peer=self.name, round=self.rounds, version=state.version, applied=settled.applied,
            loss=mean_loss(self.round_losses), val_loss=val, val_bpb=self.workload.bpb(val),
            swarm_tokens=state.tokens, lr=diloco.trainer.optimizer.param_groups[0]["lr"],
            tokens=c.tokens, tokens_trained=self.tokens_trained, from_version=c.version,
            unmerged_tokens=settled.unmerged_tokens, steps_in_flight=settled.steps_in_flight,
            step_seconds_ema=diloco.clock.step.get(), consensus_distance=distance,
            fork_distance=fork_distance(own, others_states), forked_with=forked_with(own, named),
            version_spread=max(versions) - min(versions),
            live_peers=len(versions), recovered_tokens=diloco.recovered_tokens, **self._goodput(),
            utilization=self.compute_seconds / max(wall, 1e-9), wall=wall, digest=state.digest,
            fragment=self.fragment))
        val_text = f" val {val:.4f}" if val is not None else ""
        self.progress.end_round(f"round {self.rounds}: {'merged' if settled.applied else 'not merged'} "
                                f"({o.reason}, island {len(o.members)}) v{state.version}{val_text} "
                                f"in {o.seconds:.1f}s, {settled.steps_in_flight} steps in flight, "
                                f"consensus distance {distance:.3g}")
        self.round_losses = []
        self.bytes_sent += o.bytes_sent or 0
        # a round that formed no island (rolled back before one closed) counts as alone, as the record says
        self.heartbeat.note(rounds=self.rounds, island=max(1, len(o.members)), bytes_sent=self.bytes_sent)
        self.progress.start_round(self.rounds, state.version)

    def summary(self, initial_val: Optional[float], final_val: float, device: torch.device,
                version: Optional[int] = None, digest: Optional[str] = None) -> schema.Summary:
        """`version` and `digest`: the peer's, where its global state is not this log's DiLoCo's (fragments)."""
        state, wall = self.diloco.state, time.monotonic() - self.started
        version = state.version if version is None else version
        digest = state.digest if digest is None else digest
        # utilization while training: leaving (the last round's wait, checkpoint, final evaluation) is not
        # part of it; `seconds` is the whole stay
        training = (self.training_ended or time.monotonic()) - self.started
        summary = schema.Summary(peer=self.name, rounds=self.rounds, merged_rounds=self.merged_rounds,
                                 version=version, initial_val=initial_val, final_val=final_val,
                                 final_val_bpb=self.workload.bpb(final_val),
                                 digest=digest, seconds=wall, training_seconds=training,
                                 compute_seconds=self.compute_seconds,
                                 utilization=self.compute_seconds / max(training, 1e-9), tokens=self.tokens_trained,
                                 device_peak_bytes=(torch.cuda.max_memory_allocated(device)
                                                    if device.type == "cuda" else None))
        self.metrics.write(summary)
        log.info("%s: done after %d rounds (version %d): val loss %s -> %.4f (%.4f bits per byte), compute "
                 "%.0f%% of wall time", self.name, self.rounds, version,
                 "-" if initial_val is None else f"{initial_val:.4f}", final_val, self.workload.bpb(final_val),
                 100 * summary.utilization)
        return summary
