"""The DiLoCo loop, free of networking: inner steps, contributions, rounds in flight, outer steps.

Decoupled (the default): inner training never stops for communication. Every H inner steps (or every
`round_seconds`) the peer snapshots its pseudo-gradient Δ = Θ − θ_S and hands it to the merger, which runs in
a background thread (matchmaking, all-reduce, downloads), while inner steps go on. When the outcome
arrives it is applied between two inner steps ("delayed application"):

- merged: Θ ← outer(Θ, merged) (or the group's newer Θ, downloaded), and θ ← Θ_new + (θ − θ_S): the steps
  taken while the round was in flight are kept, rebased onto the new global state;
- rolled back: nothing changes; the tokens stay unmerged and ride along with the next contribution.

With eager application (`eager=True`) the in-flight steps start instead from an estimate of the next global
model, Θ̂ = outer(Θ, w·Δ + (1−w)·Δ_last); the same rules then apply with Θ̂ in place of θ_S, and a rollback
moves θ back onto our own local progress, so nothing is lost either way.

At most one round is in flight: if a round outlasts H steps, training goes on and the next contribution,
sent once the round settles, carries the extra steps. Synchronous mode runs the same code but waits for each
round before training on (the baseline the benchmark compares against).

Invariant: when no round is in flight, every inner step since the last merge is counted in
`unmerged_tokens`/`unmerged_steps`/`unmerged_seconds` and measured by Θ − θ, so nothing is ever counted twice
or lost. `merged_seconds` is the inner-step time that reached the global model (the numerator of goodput).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Callable, ContextManager, Iterator, Optional, Protocol

import torch

from p2pdiloco.training.inner import InnerTrainer, flat_params, load_flat_params, param_slices
from p2pdiloco.protocol.outcomes import Committed, Contribution, Kept, Parts, RolledBack, RoundOutcome, Solo
from p2pdiloco.core.outer import solo_scale
from p2pdiloco.core.state import GlobalState, contains, merged_in
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.training.checkpoint import CheckpointError, Concatenated, Entry, Released
from p2pdiloco.training.spill import InMemory, OnDisk, assemble
from p2pdiloco.runtime.paging import LetGo, hold

log = logging.getLogger(__name__)


MAX_SWARM_RATE = 4096.0  # the schedule's clock runs at most this many times our own tokens


@dataclass
class SwarmRate:
    """The tokens merged into Θ per token of ours, between our last two merges: the lr schedule's clock counts
    our unmerged tokens at this rate (`DiLoCo.schedule_tokens`). `base`: Θ's tokens just after our last merge
    (None where a downloaded state came since: the rate then stays as it was until the next merge but one)."""

    rate: float = 1.0
    base: Optional[int] = None

    def merged(self, tokens: int, ours: int) -> None:
        """A merge holding `ours` of our tokens left Θ at `tokens`."""
        if self.base is not None and ours > 0:
            self.rate = min(MAX_SWARM_RATE, max(1.0, (tokens - self.base) / ours))
        self.base = tokens

    @classmethod
    def of(cls, meta: dict) -> "SwarmRate":
        """From a checkpoint's metadata (a rate of 1 and no base where it has none, or they are not numbers: the
        clock is a peer's own until its next merges, as after a join)."""
        rate, base = meta.get("swarm_rate", 1.0), meta.get("merge_base")
        if not isinstance(rate, (int, float)) or not math.isfinite(rate):
            rate = 1.0
        return cls(min(MAX_SWARM_RATE, max(1.0, float(rate))), base if isinstance(base, int) and base >= 0 else None)


class Progress(Enum):
    """What of θ's local progress a rebase onto a new Θ keeps."""

    SINCE_SNAPSHOT = "since snapshot"  # our Δ reached Θ: only the steps taken while its round ran
    ALL_UNMERGED = "all unmerged"  # our Δ did not: every step since our last merge


class Merger(Protocol):
    def merge(self, c: Contribution) -> RoundOutcome: ...


class SoloMerger:
    """No network: a swarm of one. Used by unit tests and as the single-peer baseline."""

    def merge(self, c: Contribution) -> RoundOutcome:
        return Solo.of(c)


@dataclass
class InFlight:
    """A round in flight keeps no model-sized vector of its own beside its Δ, which waits on disk where the peer
    has a folder for it (training.spill): Θ does not change while the round runs (only this thread applies
    outcomes, one round at a time), so Θ_S is Θ itself until the outcome lands, and θ_S = Θ_S − Δ. (Eager
    updates also keep the estimate they started from.)"""

    future: Future
    contribution: Contribution
    started: float
    steps_at_snapshot: int
    origin: Optional[torch.Tensor] = None  # eager: the estimate of Θ' the in-flight steps start from

    @property
    def kept(self) -> Kept:
        """Δ as fork recovery will keep it, should this round merge."""
        return self.contribution.kept


@dataclass
class LastMerge:
    """Our latest contribution that reached Θ: if we later adopt a state that does not descend from
    `key` (our island lost a fork), this progress is restored locally and contributed again."""

    key: tuple[int, str]  # the global state right after it was merged
    delta: Kept  # in memory, or on disk until a lost fork needs it (p2pdiloco.training.spill)
    tokens: int
    steps: int
    seconds: float


@dataclass
class Settled:
    """One round, as seen by this peer once its outcome was applied."""

    outcome: RoundOutcome
    contribution: Contribution
    applied: bool  # our contribution reached the global state we now hold
    steps_in_flight: int  # inner steps taken while the round ran (0 in synchronous mode)
    unmerged_tokens: int  # after applying


class DiLoCo:
    """Owns θ (the trainer's model), Θ (GlobalState) and the bookkeeping between rounds."""

    def __init__(self, trainer: InnerTrainer, state: GlobalState, merger: Merger, peer: str, name: str,
                 clock: Optional[RoundClock] = None, eager: bool = False,
                 keep: InMemory | OnDisk | None = None):
        self.trainer, self.state, self.merger, self.peer, self.name = trainer, state, merger, peer, name
        self.keep = keep or InMemory()  # where our Δ waits after its round, for fork recovery
        self.clock = clock or RoundClock()
        self.eager = eager
        self.last_merged: Optional[torch.Tensor] = None  # the latest merged update we applied (eager estimates)
        self.last_weight = 1.0  # our share of it
        self._nothing_unmerged()  # the unmerged counters: since the last contribution that reached Θ
        self.merged_seconds = 0.0  # inner-step time whose progress reached the global model
        self.in_flight: Optional[InFlight] = None
        self.last_merge: Optional[LastMerge] = None
        self.recovered_tokens = 0  # tokens of merges lost in forks and contributed again (a metric)
        # restored from a checkpoint whose unmerged progress a later contribution carried, from this version (and
        # the data stream's position then): an island may have merged it after we stopped (`adopt` decides)
        self.unsettled: Optional[dict] = None
        self.settled_step = -1  # the inner step at which the latest contribution whose outcome we applied left
        self.swarm_rate = SwarmRate(base=state.tokens)  # the schedule's clock between merges
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round")

    # ---- inner steps --------------------------------------------------------------------------------------
    def inner_step(self) -> tuple[float, float]:
        loss, seconds = self.trainer.timed_step(self.schedule_tokens)
        self.count_step(seconds)
        return loss, seconds

    def count_step(self, seconds: float, share: float = 1.0) -> None:
        """One inner step of θ is unmerged progress now. `share`: the part of its time that trained what this
        DiLoCo merges (training.fragments: a fragment's, so that the fragments' merged seconds add up to the
        step's); its tokens count whole, as the merge weights and the schedule's clock count them."""
        self.unmerged_tokens += self.trainer.tokens_per_step
        self.unmerged_steps += 1
        self.unmerged_seconds += seconds * share
        self.clock.step.update(seconds)

    @property
    def swarm_tokens(self) -> int:
        """The swarm's progress as this peer sees it: the tokens merged into Θ, and ours not merged yet (the
        learning-rate schedule's clock)."""
        return self.state.tokens + self.unmerged_tokens

    @property
    def schedule_tokens(self) -> int:
        """The learning-rate schedule's clock: the tokens merged into Θ, and ours not merged yet times the rate at
        which the swarm merged tokens per token of ours between our last two merges (while we train, the others
        do). In a swarm of M equal peers the clock then runs as data-parallel's does over M× the batch, not M
        times slower between merges; alone, or before our first merge, it is `swarm_tokens`."""
        return self.state.tokens + round(self.unmerged_tokens * self.swarm_rate.rate)

    def local_params(self) -> torch.Tensor:
        return flat_params(self.trainer.model)

    # ---- contributing -------------------------------------------------------------------------------------
    def contribute(self) -> None:
        """Snapshot Δ and hand it to the merger in the background; training goes on at once."""
        assert self.in_flight is None, "one round in flight at a time"
        self.unsettled = None  # what we contribute now is ours to merge, once
        with self.state.lock:
            if self.eager:  # the estimate needs Δ whole
                delta = pseudo_gradient_of(self.trainer.model, self.state.params, let_go=self.state.let_go)
                kept, origin = self.keep.put(delta), self._eager_estimate(delta)
                del delta  # from here on the merger and the spill hold it, as long as each needs it
            else:  # a parameter's worth at a time, straight to where it waits (no model-sized Δ on disk's way)
                kept, origin = self.keep.put_parts(lambda: pseudo_gradient_parts(
                    self.trainer.model, self.state.params, let_go=self.state.let_go), self.state.params.numel()), None
            c = Contribution(kept=kept, tokens=self.unmerged_tokens, steps=self.unmerged_steps,
                             version=self.state.version, peer=self.peer, name=self.name, digest=self.state.digest,
                             seconds=self.unmerged_seconds, merged_by=len(self.state.last_members))
        future = self._executor.submit(self.merger.merge, c)
        if origin is not None:
            load_flat_params(self.trainer.model, origin)
            self.trainer.theta_written()
        self.in_flight = InFlight(future, c, time.monotonic(), self.trainer.total_steps, origin)

    def _eager_estimate(self, delta: torch.Tensor) -> torch.Tensor:
        """Eager updates (Kale et al. 2025, arXiv 2502.12996): instead of training on from θ_S while the round
        is in flight, go on from an estimate of the next global model: the outer step of our fresh Δ, weighted
        by our share of the last round, plus the last merged update standing in for the others' part."""
        if self.last_merged is None:
            estimate = delta
        else:
            estimate = delta * self.last_weight + self.last_merged * (1.0 - self.last_weight)
        return self.state.outer.lookahead(estimate)

    def poll(self) -> Optional[Settled]:
        """Apply the outcome of the round in flight if it has arrived; never blocks."""
        if self.in_flight is None or not self.in_flight.future.done():
            return None
        return self._settle()

    def wait(self, timeout: Optional[float] = None) -> Optional[Settled]:
        """Block until the round in flight settles, then apply it; TimeoutError if it does not in time."""
        if self.in_flight is None:
            return None
        done, _ = concurrent.futures.wait([self.in_flight.future], timeout)
        if not done:
            raise TimeoutError(f"the round in flight did not settle within {timeout} s")
        return self._settle()

    def _settle(self) -> Settled:
        flight, self.in_flight = self.in_flight, None
        self.settled_step = flight.steps_at_snapshot
        try:
            outcome = flight.future.result()
        except Exception as e:  # a merger bug must cost one round, never the peer
            outcome = RolledBack(reason=f"merger error: {type(e).__name__}: {e}",
                                 seconds=time.monotonic() - flight.started)
        applied = self.apply(outcome, flight)
        return Settled(outcome, flight.contribution, applied,
                       self.trainer.total_steps - flight.steps_at_snapshot, self.unmerged_tokens)

    def apply(self, outcome: RoundOutcome, flight: InFlight) -> bool:
        """Apply a round's outcome; True if the global state we now hold contains our contribution."""
        try:
            return self._apply(outcome, flight)
        finally:
            if self.last_merge is None or self.last_merge.delta is not flight.kept:
                flight.kept.drop()  # not our last merge: fork recovery will never need it

    def _apply(self, outcome: RoundOutcome, flight: InFlight) -> bool:
        c = flight.contribution
        committed = isinstance(outcome, (Committed, Solo))
        if committed:
            kept = Progress.SINCE_SNAPSHOT  # progress up to θ_S is now in Θ
        elif outcome.adopted or flight.origin is not None:
            kept = Progress.ALL_UNMERGED  # our Δ did not reach Θ (eager: back from the estimate to our own progress)
        else:
            return False  # rolled back, left, or adopted nothing: θ and Θ stay exactly as they are
        held = False
        with self.state.lock:
            # θ ← θ − base before Θ changes: the base is expressed through Θ_S
            progress_lost = not self._keep_progress(flight, kept)
            restored = None
            try:
                if outcome.state_before is not None:
                    restored = self._load_foreign(*outcome.state_before)
                if committed:
                    scale = solo_scale(self.state.island_sizes()) if isinstance(outcome, Solo) else 1.0
                    if scale != 1.0:
                        log.info("%s: merged alone after merges of up to %d members: our Δ counts as one of them "
                                 "(× %.3g)", self.name, round(1 / scale), scale)
                    if outcome.merged is not None:  # how far a merge moves us bounds what we download later
                        self.state.saw_merge(outcome.merged, outcome.let_go, scale)
                    if outcome.state is not None:
                        restored = self._add(restored, self._load_foreign(*outcome.state))  # already holds our Δ
                    elif not outcome.stale:
                        self.state.apply(outcome.merged, [m.peer for m in outcome.members], outcome.let_go,
                                         tokens=outcome.merged_tokens, scale=scale)
                    self.unmerged_tokens -= c.tokens
                    self.unmerged_steps -= c.steps
                    self.unmerged_seconds -= c.seconds
                    self.merged_seconds += c.seconds
                    # stale and no download: our Δ lives in the group's state, not in ours; we catch up later
                    held = not (outcome.stale and outcome.state is None)
                    if held:
                        self.swarm_rate.merged(self.state.tokens, c.tokens)
                    self._forget_last_merge()
                    if held:
                        self.last_merge = LastMerge(self.state.key, flight.kept, c.tokens, c.steps, c.seconds)
                    # only eager estimates use the last merged update, a copy: outcome.merged may view the
                    # averager's buffer, which the next round overwrites
                    eager_copy = self.eager and outcome.merged is not None
                    self.last_merged = outcome.merged.clone() if eager_copy else None
                    self.last_weight = own_weight(outcome, self.peer)
                elif outcome.state is not None:
                    restored = self._add(restored, self._load_foreign(*outcome.state))
            finally:  # θ ← Θ + progress [+ restored], whatever Θ now is
                self._add_global(restored)
            if progress_lost:
                self._nothing_unmerged()
        if outcome.sync_seconds:
            self.clock.sync.update(outcome.sync_seconds)
        self.clock.quorum.update(outcome.quorum_seconds)
        return held

    def _load_foreign(self, metadata: dict, tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
        """Load a peer's global state. If it does not contain our latest merge (our island lost a fork),
        return that merge's local progress, −Δ, to restore: its tokens count as unmerged again."""
        lost = self.last_merge is not None and not contains(metadata, self.last_merge.key)
        restored = None
        if lost:
            delta = read_back(self.last_merge.delta, "the Δ our island merged in a lost fork")
            self.merged_seconds -= self.last_merge.seconds  # it did not reach the global model after all
            if delta is not None:
                restored = delta.neg()
                self.unmerged_tokens += self.last_merge.tokens
                self.unmerged_steps += self.last_merge.steps
                self.unmerged_seconds += self.last_merge.seconds
                self.recovered_tokens += self.last_merge.tokens
            self._forget_last_merge()
        self.state.load(metadata, tensors)
        self.swarm_rate.base = None  # Θ's tokens now count others' merges from before our last one too
        return restored

    def _forget_last_merge(self) -> None:
        if self.last_merge is not None:
            self.last_merge.delta.drop()
            self.last_merge = None

    @staticmethod
    def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return b if a is None else a if b is None else a + b

    # ---- rebasing θ onto a new Θ: θ ← Θ_new + (θ − base) [+ restored], in two passes around Θ's change -------
    # In place, one parameter at a time: no model-sized temporaries, and no snapshot of θ or Θ kept while a
    # round is in flight. On a CPU the arithmetic runs in the parameter's own memory (fp32, contiguous).
    def _keep_progress(self, flight: Optional[InFlight], kept: Progress) -> bool:
        """θ ← θ − base, while Θ is still Θ_S. Delayed application: θ_S = Θ_S − Δ, so the progress since the
        snapshot is (θ − Θ_S) + Δ, and all unmerged progress is θ − Θ_S. Eager: the in-flight steps started from
        the estimate, so the progress since the snapshot is θ − origin, and all of it θ − origin − Δ.
        θ_S rebuilt as Θ_S − Δ differs from the θ_S of the snapshot by at most an ulp of Δ (θ is local, and
        resumed runs stay bit-exact). With no step in flight the progress is exactly 0, as IEEE rounding is
        symmetric: (θ_S − Θ_S) + Δ = −Δ + Δ; so θ becomes Θ' bit for bit.
        False if Δ, needed here, could not be read back (training.spill): the progress is then 0, and θ becomes
        Θ' (our local progress is lost, never the global state)."""
        origin = None if flight is None else flight.origin
        measured_with_delta = Progress.SINCE_SNAPSHOT if origin is None else Progress.ALL_UNMERGED
        uses_delta = flight is not None and kept == measured_with_delta
        delta = parts_of(flight.kept, "the round's Δ") if uses_delta else None  # read a parameter at a time
        if uses_delta and delta is None:
            self._progress_lost()
            return False
        try:
            with torch.no_grad():
                for _, p, part in param_slices(self.trainer.model):
                    progress = _flat(p)
                    if origin is None:
                        progress.sub_(self.state.params[part])
                        if kept == Progress.SINCE_SNAPSHOT:
                            progress.add_(delta[part])
                    else:
                        progress.sub_(origin[part])
                        if kept == Progress.ALL_UNMERGED:
                            progress.sub_(delta[part])
                    _store(p, progress)
                    self.state.let_go(part)
        except (OSError, ValueError) as e:  # Δ's file failed halfway: no parameter's progress can be trusted
            _gave_up("the round's Δ", e)
            self._progress_lost()
            return False
        return True

    def _progress_lost(self) -> None:
        """θ ← 0 as the progress, so the second pass makes θ = Θ' (our local progress is lost, never Θ)."""
        self.trainer.theta_written()
        with torch.no_grad():
            for _, p, _part in param_slices(self.trainer.model):
                p.detach().zero_()

    def _add_global(self, restored: Optional[torch.Tensor]) -> None:
        """θ ← progress [+ restored] + Θ (the second pass)."""
        self.trainer.theta_written()
        with torch.no_grad():
            for _, p, part in param_slices(self.trainer.model):
                progress = _flat(p)
                if restored is not None:
                    progress.add_(restored[part])
                _store(p, progress.add_(self.state.params[part]))
                self.state.let_go(part)

    def adopt(self, metadata: dict, tensors: list[torch.Tensor]) -> None:
        """Take a global state from a peer between rounds (joining, or behind): rebase unmerged progress."""
        assert self.in_flight is None
        self._settle_restored(metadata)
        with self.state.lock:
            self._keep_progress(None, Progress.ALL_UNMERGED)
            restored = None
            try:
                restored = self._load_foreign(metadata, tensors)
            finally:
                self._add_global(restored)

    def abandon(self) -> None:
        """Leave without the round in flight's outcome: Θ is untouched and its tokens stay unmerged, with θ
        holding all our local progress, as after a rollback. Should the island still merge it, our next start
        finds the swarm past its version and gives that progress up (`unsettled`): never counted twice."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return
        self.unsettled = unsettled_by(flight.contribution)
        if flight.origin is not None:
            with self.state.lock:
                if not self._keep_progress(flight, Progress.ALL_UNMERGED):
                    self._nothing_unmerged()
                self._add_global(None)
        flight.kept.drop()

    def _settle_restored(self, metadata: dict) -> None:
        """A state past the version our unsettled contribution left from may hold it. Where the state names the
        merges since (`core.state.merged_in`): merged, its steps reached Θ (counted merged now, as the life that
        made them could not) and θ gives them up; not merged, θ keeps them and they go out again. Where it cannot
        tell: give the progress it carried up (θ ← Θ, so the rebase adds nothing) and skip its batches."""
        unsettled, self.unsettled = self.unsettled, None
        version = int(metadata["version"])
        if unsettled is None or version <= unsettled["version"]:
            return
        merged = merged_in(metadata, unsettled.get("peer"), unsettled["version"])
        if merged is False:
            log.info("%s: the swarm is at v%d, and no merge since v%d holds our last contribution (we stopped with "
                     "it in flight): its steps are contributed again", self.name, version, unsettled["version"])
            return
        if merged:
            self.merged_seconds += _seconds(unsettled.get("seconds"))
            log.info("%s: the swarm is at v%d, which holds our last contribution (from v%d; we stopped with it in "
                     "flight): its steps are merged, and not contributed again", self.name, version,
                     unsettled["version"])
        else:
            log.info("%s: the swarm is at v%d, past our last contribution (from v%d) that our checkpoint predates: its "
                     "steps may be merged already, so they are not contributed again", self.name, version,
                     unsettled["version"])
        with self.state.lock:
            self._progress_lost()
            self._add_global(None)
        self._nothing_unmerged()
        if unsettled.get("stream_position") is not None and hasattr(self.trainer.batches, "position"):
            self.trainer.batches.position = max(self.trainer.batches.position, int(unsettled["stream_position"]))

    def _nothing_unmerged(self) -> None:
        """θ is Θ now (local progress given up): no tokens wait for a merge any more."""
        self.unmerged_tokens = self.unmerged_steps = 0
        self.unmerged_seconds = 0.0

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.keep.close()

    # ---- resuming ---------------------------------------------------------------------------------------
    @property
    def can_checkpoint(self) -> bool:
        """Between rounds always; with a round in flight unless eager (θ then starts from an estimate, not Θ)."""
        return self.in_flight is None or self.in_flight.origin is None

    def checkpoint_state(self) -> tuple[dict, dict[str, Entry]]:
        """Everything a restarted peer needs to go on exactly where it stopped: Θ, momentum and version, θ,
        the AdamW moments, the step count, the data stream's position and the unmerged counters. With a round in
        flight (Θ is Θ_S until its outcome lands, and θ holds all our unmerged progress), the contribution is
        unsettled: its island may merge it after we stop, so a restart finding the swarm past its version gives
        the unmerged progress up (`_settle_restored`), rather than risk counting it twice."""
        assert self.can_checkpoint, "an eager peer checkpoints between rounds only"
        with self.state.lock:  # no copies of Θ: only this (the training) thread changes it, and it is saving
            let_go = self.state.let_go
            tensors = {"global": Released(self.state.params, let_go),
                       "momentum": Released(self.state.outer.momentum_buffer, let_go)}
            meta = self.rounds_checkpoint()
        trainer_meta, trainer_tensors = trainer_checkpoint(self.trainer)
        meta.update(trainer_meta)
        tensors.update(trainer_tensors)
        return meta, tensors

    def checkpoint_guard(self) -> Callable[[], ContextManager]:
        """Held while a checkpoint writes Θ in the background: raises StateChanged if a round changed it since
        this was taken."""
        return functools.partial(self.state.unchanged, self.state.generation)

    def rounds_checkpoint(self) -> dict:
        """What of a checkpoint's metadata is this DiLoCo's own (not the trainer's): Θ's version and lineage, and
        the unmerged counters."""
        flight = self.in_flight
        unsettled = self.unsettled if flight is None else unsettled_by(flight.contribution)
        return dict(version=self.state.version, digest=self.state.digest, history=self.state.history,
                    merges=self.state.merges,
                    last_members=self.state.last_members, tokens=self.state.tokens,
                    unmerged_tokens=self.unmerged_tokens, unmerged_steps=self.unmerged_steps,
                    unmerged_seconds=self.unmerged_seconds, unsettled=unsettled, settled_step=self.settled_step,
                    swarm_rate=self.swarm_rate.rate, merge_base=self.swarm_rate.base)

    def restore_checkpoint_state(self, meta: dict, tensors: dict[str, torch.Tensor],
                                 contributed: Optional[dict] = None) -> Optional[str]:
        """Resume from a checkpoint; a note for the log where not everything could be restored. `contributed`:
        our newest contribution as noted when it left (`checkpoint.note_contribution`): one made after this
        checkpoint carried its unmerged progress, and its outcome is unknown until we see the swarm."""
        note = restore_trainer(self.trainer, meta, tensors)
        self.restore_rounds(meta, [tensors["global"], tensors["momentum"]], contributed)
        return note

    def restore_rounds(self, meta: dict, state: list[torch.Tensor], contributed: Optional[dict] = None) -> None:
        """Θ and the momentum (`state`), and `rounds_checkpoint`'s metadata, back."""
        self.state.load(dict(version=meta["version"], digest=meta["digest"], history=meta.get("history", []),
                             last_members=meta.get("last_members", []), tokens=meta.get("tokens", 0),
                             merges=meta.get("merges")), state)
        self.unmerged_tokens, self.unmerged_steps = meta["unmerged_tokens"], meta["unmerged_steps"]
        self.unmerged_seconds = float(meta.get("unmerged_seconds", 0.0))
        left = meta.get("unsettled")  # left with a round in flight
        self.unsettled = left if isinstance(left, dict) and isinstance(left.get("version"), int) else None
        self.settled_step = int(meta.get("settled_step", -1))
        self.swarm_rate = SwarmRate.of(meta)
        if contributed is not None and contributed["inner_step"] > self.settled_step:  # left after we saved
            # a contribution our last life saw merged was counted merged then (`checkpoint.note_merged`)
            self.unsettled = dict(version=contributed["version"], stream_position=contributed.get("stream_position"),
                                  peer=contributed.get("peer"),
                                  seconds=0.0 if contributed.get("merged") else contributed.get("seconds"))


def _seconds(raw) -> float:
    """Seconds read back from our own files: anything but a finite non-negative number counts as none."""
    return float(raw) if isinstance(raw, (int, float)) and math.isfinite(raw) and raw >= 0 else 0.0


def unsettled_by(c: Contribution) -> dict:
    """What a restart needs of a contribution whose outcome we did not see: where it left from, and who sent it
    (our peer id may differ next life) with how many inner-step seconds, to tell whether an island merged it."""
    return dict(version=c.version, stream_position=None, peer=c.peer, seconds=c.seconds)


def trainer_checkpoint(trainer: InnerTrainer) -> tuple[dict, dict[str, Entry]]:
    """θ, the inner optimizer's state, the step count and the data stream's position: a checkpoint's part that is
    the trainer's, whatever merges its model (one DiLoCo, or the fragments of training.fragments)."""
    tensors = {"local": Concatenated([p for _, p, _ in param_slices(trainer.model)])}
    moments, scalars = trainer.checkpoint_moments()
    tensors.update(moments)
    meta = dict(inner_optimizer=trainer.cfg.optimizer, inner_scalars=scalars, inner_step=trainer.total_steps,
                stream_position=getattr(trainer.batches, "position", None),
                stream_seed=getattr(trainer.batches, "seed", None),
                stream_at=trainer.batches.where() if hasattr(trainer.batches, "where") else None)
    return meta, tensors


def restore_trainer(trainer: InnerTrainer, meta: dict, tensors: dict[str, torch.Tensor]) -> Optional[str]:
    """`trainer_checkpoint`'s part back; a note for the log where the moments could not be."""
    load_flat_params(trainer.model, tensors["local"])
    trainer.theta_written()
    note = None
    if meta.get("inner_optimizer", "adamw") == trainer.cfg.optimizer:
        try:
            trainer.restore_optimizer_state(tensors, meta.get("inner_scalars") or {}, step=int(meta["inner_step"]))
        except CheckpointError as e:  # θ, Θ and the counters are read and verified: the moments alone are lost
            trainer.optimizer.state.clear()
            note = f"{e}: the inner optimizer's moments start afresh"
    else:  # the user switched optimizers: the weights carry over, the moments start afresh
        note = (f"the checkpoint's inner optimizer was {meta.get('inner_optimizer')}, this run's is "
                f"{trainer.cfg.optimizer}: its moments start afresh")
    trainer.total_steps = int(meta["inner_step"])
    if meta.get("stream_seed") is not None:  # our own data order, whatever our peer id is this time
        trainer.batches.seed = int(meta["stream_seed"])
    if meta.get("stream_position") is not None:
        trainer.batches.position = int(meta["stream_position"])
    return note


def _flat(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a flat fp32 CPU vector: on a CPU, the parameter's own memory."""
    return p.detach().float().cpu().reshape(-1)


def _store(p: torch.Tensor, flat: torch.Tensor) -> None:
    if flat.data_ptr() != p.data_ptr():  # a GPU (or non-fp32) parameter: copy the result back
        p.detach().copy_(flat.view_as(p))


def pseudo_gradient_of(model: torch.nn.Module, global_params: torch.Tensor,
                       let_go: LetGo = hold) -> torch.Tensor:
    """Δ = Θ − θ (`core.outer.pseudo_gradient`) whole, made a parameter at a time: the same bits without a flat
    copy of θ. `let_go` is told each part of Θ that was read."""
    return assemble(lambda: pseudo_gradient_parts(model, global_params, let_go), global_params.numel())


def pseudo_gradient_parts(model: torch.nn.Module, global_params: torch.Tensor,
                          let_go: LetGo = hold) -> Iterator[torch.Tensor]:
    """Δ = Θ − θ a parameter at a time, in the flat layout's order: the same bits as `pseudo_gradient_of`."""
    with torch.no_grad():
        for _, p, part in param_slices(model):
            piece = global_params[part] - _flat(p)
            let_go(part)
            yield piece


def parts_of(kept: Kept, what: str) -> Optional[Parts]:
    """`read_back`, a slice at a time (the file opened and checked now; None if it cannot be)."""
    try:
        return kept.parts()
    except (OSError, ValueError) as e:
        _gave_up(what, e)
        return None


def read_back(kept: Kept, what: str) -> Optional[torch.Tensor]:
    """A Δ from where it waited, or None if it cannot be read (its file removed or damaged): the caller then
    gives up the local progress it measures, with this warning; Θ never depends on it."""
    try:
        return kept.get()
    except (OSError, ValueError) as e:
        _gave_up(what, e)
        return None


def _gave_up(what: str, error: Exception) -> None:
    log.warning("could not read back %s (%s): the local progress it measures is given up", what, error)


def own_weight(outcome: RoundOutcome, peer: str) -> float:
    """Our share of a merged round (equal shares if the records do not say)."""
    for member, weight in zip(outcome.members, outcome.weights):
        if member.peer == peer:
            return float(weight)
    return 1.0 / max(1, len(outcome.members))


def train(diloco: DiLoCo, steps_per_round: int, should_leave: Callable[[], bool],
          on_step: Callable[[float, float], None] = lambda loss, seconds: None,
          on_round: Callable[[Settled], None] = lambda s: None, synchronous: bool = False,
          round_seconds: Optional[float] = None,
          final_wait: Callable[[], float] = lambda: 120.0,
          on_contribute: Callable[[Contribution], None] = lambda c: None,
          ready: Callable[[], bool] = lambda: True) -> None:
    """Run inner steps until `should_leave()`; contribute every `steps_per_round` steps (or every
    `round_seconds`, a time-budgeted H that sizes each peer's rounds to its speed), once `ready()` (a restarted
    peer trains while it joins, and contributes only once it has)."""
    since_steps, since_time = 0, time.monotonic()
    while not should_leave():
        due = since_steps >= steps_per_round if round_seconds is None else (
            since_steps > 0 and time.monotonic() - since_time >= round_seconds)
        if due and diloco.in_flight is None and ready():
            diloco.contribute()
            on_contribute(diloco.in_flight.contribution)
            since_steps, since_time = 0, time.monotonic()
            if synchronous:
                on_round(diloco.wait())
                continue
        loss, seconds = diloco.inner_step()
        since_steps += 1
        on_step(loss, seconds)
        settled = diloco.poll()
        if settled is not None:
            on_round(settled)
    if diloco.in_flight is not None:  # let the round finish: abandoning it costs our island a retry
        try:
            on_round(diloco.wait(timeout=final_wait()))
        except TimeoutError:
            diloco.abandon()
