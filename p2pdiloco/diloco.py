"""The DiLoCo round, free of networking: inner steps, pseudo-gradient, merge (injected), outer step.

Round outcomes and what they do to this peer's state:
- committed at our version: apply the outer step to Θ, version += 1, θ ← Θ, pending tokens reset;
- committed but the group held a newer version (we were stale): our Δ was merged by them; resync Θ;
- rolled back (failed/partial/unverified round): Θ untouched, θ keeps its progress, tokens accumulate,
  so the next contribution covers both rounds and nothing is lost.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from p2pdiloco.exact import digest
from p2pdiloco.inner import InnerReport, InnerTrainer, flat_params, load_flat_params
from p2pdiloco.outer import OuterOptimizer, pseudo_gradient
from p2pdiloco.roundtypes import Contribution, MergeOutcome


class Merger(Protocol):
    def merge(self, c: Contribution) -> MergeOutcome: ...


class SoloMerger:
    """No network: a swarm of one. Used by unit tests and as the single-peer baseline."""

    def merge(self, c: Contribution) -> MergeOutcome:
        import time

        return MergeOutcome.solo(c, time.monotonic())


class GlobalState:
    """Θ, the outer momentum and the version; `snapshot` is thread-safe (state sharing runs in a thread)."""

    def __init__(self, params: torch.Tensor, lr: float, momentum: float):
        self.outer = OuterOptimizer(params.clone(), lr, momentum)
        self.version = 0
        self.last_members: list[str] = []
        self.lock = threading.Lock()

    @property
    def params(self) -> torch.Tensor:
        return self.outer.params

    @property
    def digest(self) -> str:
        return digest(self.params)

    def apply(self, merged: torch.Tensor, members: list[str]) -> None:
        with self.lock:
            self.outer.step(merged)
            self.version += 1
            self.last_members = members

    def snapshot(self) -> tuple[dict, list[torch.Tensor]]:
        with self.lock:
            metadata = dict(version=self.version, digest=self.digest, last_members=list(self.last_members))
            return metadata, [t.clone() for t in self.outer.state_tensors()]

    def load(self, metadata: dict, tensors: list[torch.Tensor]) -> None:
        with self.lock:
            self.outer.load_state_tensors(*tensors)
            self.version = metadata["version"]
            self.last_members = list(metadata.get("last_members", []))


def validate_state(metadata, tensors, n_params: int, min_version: int) -> Optional[str]:
    """Why a state downloaded from a remote peer is unacceptable, or None. Never trust the network."""
    if not isinstance(metadata, dict) or not isinstance(metadata.get("version"), int):
        return "metadata is not a dict with an integer version"
    if metadata["version"] < min_version:
        return f"donor is at version {metadata['version']}, older than ours ({min_version})"
    if len(tensors) != 2 or any(t.dtype != torch.float32 or t.shape != (n_params,) for t in tensors):
        return "tensors do not match this model"
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        return "tensors contain NaN or infinity"
    if digest(tensors[0]) != metadata.get("digest"):
        return "parameters do not match the donor's announced digest"
    return None


@dataclass
class RoundResult:
    report: InnerReport
    outcome: MergeOutcome
    applied: bool
    pending_tokens: int


class DiLoCo:
    """Owns θ (the trainer's model), Θ (GlobalState) and the bookkeeping between rounds."""

    def __init__(self, trainer: InnerTrainer, state: GlobalState, merger: Merger, peer: str, name: str):
        self.trainer, self.state, self.merger, self.peer, self.name = trainer, state, merger, peer, name
        self.pending_tokens = 0  # tokens since our last merged contribution
        self.pending_steps = 0

    def local_params(self) -> torch.Tensor:
        return flat_params(self.trainer.model)

    def contribution(self) -> Contribution:
        delta = pseudo_gradient(self.state.params, self.local_params())
        return Contribution(delta=delta, tokens=self.pending_tokens, steps=self.pending_steps,
                            version=self.state.version, peer=self.peer, name=self.name, digest=self.state.digest)

    def run_round(self, steps: int, on_step=lambda i, loss: None, should_stop=lambda: False) -> RoundResult:
        report = self.trainer.run(steps, on_step=on_step, should_stop=should_stop)
        self.pending_tokens += report.tokens
        self.pending_steps += report.steps
        if self.pending_tokens == 0:
            return RoundResult(report, MergeOutcome(merged=None, reason="no steps"), False, 0)
        outcome = self.merger.merge(self.contribution())
        applied = self.finish(outcome)
        return RoundResult(report, outcome, applied, self.pending_tokens)

    def finish(self, outcome: MergeOutcome) -> bool:
        if not outcome.committed or outcome.max_version > self.state.version:
            return False  # rolled back, or stale: the caller resyncs Θ from a peer
        self.state.apply(outcome.merged, [m["peer"] for m in outcome.members])
        self.reset_local_to_global()
        return True

    def reset_local_to_global(self) -> None:
        load_flat_params(self.trainer.model, self.state.params)
        self.pending_tokens = self.pending_steps = 0

    def adopt(self, metadata: dict, tensors: list[torch.Tensor]) -> None:
        """Take a newer global state from a peer. If our pending work was merged into it, start afresh from
        it; otherwise keep our pending progress by rebasing θ onto it: θ ← Θ_new − Δ_pending."""
        pending = pseudo_gradient(self.state.params, self.local_params())
        self.state.load(metadata, tensors)
        if self.peer in self.state.last_members or self.pending_tokens == 0:
            self.reset_local_to_global()
        else:
            load_flat_params(self.trainer.model, self.state.params - pending)
