"""Streaming fragments on one peer: θ trained as one model, merged as P fragments (core.fragments), each with
its own Θ part, version, outer momentum, error feedback and rounds.

Each fragment is a whole `training.diloco.DiLoCo` over its part of the model: the delayed application, the
rebase of the steps taken while a round was in flight, commit-or-rollback and fork recovery are the ones a peer
runs with P = 1, applied to the fragment's elements only. What a fragment's DiLoCo sees as its model is a
`FragmentView`: the fragment's runs of rows, as views into the trainer's parameters, so the rebase writes θ in
place and no fragment keeps a copy of the model. One inner step of the trainer counts as an unmerged step of
every fragment (`Streams.inner_step`); fragment i's rounds leave on the staggered schedule of `Stagger`.
"""

from __future__ import annotations

import contextlib

from typing import Callable, ContextManager, Iterator, Optional, Sequence

import torch

from p2pdiloco.core.exact import digest
from p2pdiloco.core.fragments import RULE, Fragment, Stagger, split
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.protocol.outcomes import Contribution
from p2pdiloco.training.checkpoint import CheckpointError, Concatenated, Entry
from p2pdiloco.training.diloco import DiLoCo, Merger, Settled, restore_trainer, trainer_checkpoint
from p2pdiloco.training.inner import InnerTrainer, param_slices


def model_fragments(model: torch.nn.Module, p: int) -> tuple[Fragment, ...]:
    """The model's P fragments, by the split every peer computes alike (core.fragments.RULE)."""
    return split([(name, tuple(param.shape)) for name, param, _ in param_slices(model)], p)


class FragmentView:
    """A fragment of a model, as `param_slices` and the flat-vector helpers read a model: its pieces in layout
    order, each a flat view of the rows it holds (detached: written in place, outside autograd)."""

    def __init__(self, model: torch.nn.Module, fragment: Fragment):
        self.model, self.fragment = model, fragment
        self._params: Optional[dict[str, torch.Tensor]] = None

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        # the model's Parameters by name, looked up once: a walk of the module tree at every call was a sixth of a
        # fragment's settle on the training thread. A write of θ rebinds a Parameter's data, never the Parameter
        # (training.parked), so each view below is taken afresh from it
        if self._params is None:
            self._params = dict(self.model.named_parameters())
        for piece in self.fragment.pieces:
            param = self._params[piece.name].detach()
            if not param.is_contiguous():
                raise ValueError(f"fragments: {piece.name} is not contiguous, so its rows have no flat view")
            yield f"{piece.name}[{piece.start}:{piece.stop}]", param.view(-1)[piece.start:piece.stop]

    def parameters(self) -> Iterator[torch.Tensor]:
        return (p for _, p in self.named_parameters())


class FragmentTrainer:
    """What a fragment's DiLoCo asks of the trainer: θ (its view), the step count, the tokens of a step, and
    the note that θ was written. The inner steps themselves are `Streams`'s: one for every fragment."""

    def __init__(self, trainer: InnerTrainer, fragment: Fragment):
        self.trainer, self.fragment = trainer, fragment
        self.model = FragmentView(trainer.model, fragment)

    @property
    def total_steps(self) -> int:
        return self.trainer.total_steps

    @property
    def tokens_per_step(self) -> int:
        return self.trainer.tokens_per_step

    @property
    def cfg(self):
        return self.trainer.cfg

    @property
    def on_gpu(self) -> bool:
        return self.trainer.on_gpu

    @property
    def optimizer(self):
        return self.trainer.optimizer

    @property
    def batches(self):
        return self.trainer.batches

    def theta_written(self) -> None:
        self.trainer.theta_written()

    def timed_step(self, progress: Optional[int] = None):
        raise RuntimeError("a fragment does not step alone: Streams.inner_step steps the model once for all")


def fragment_states(full: GlobalState, fragments: Sequence[Fragment]) -> list[GlobalState]:
    """Each fragment's part of a global state at version 0 (where every fragment starts), kept in `full`'s own two
    vectors: their values are laid out again fragment after fragment, so that each fragment's Θ and momentum are
    one slice of them. A pair of vectors for each fragment beside them held P = 1's state twice (8 bytes per
    parameter more). From then on `full` is the fragments' storage, not a state in the model's layout."""
    theta, momentum = full.outer.state_tensors()
    laid_out = torch.cat([theta[piece.flat] for fragment in fragments for piece in fragment.pieces])
    if laid_out.numel() != theta.numel():
        raise ValueError(f"the fragments hold {laid_out.numel()} values of a state of {theta.numel()}")
    theta.copy_(laid_out)
    del laid_out  # (a copy of Θ while the state is rearranged, once at the start)
    momentum.zero_()
    states, start = [], 0
    for fragment in fragments:
        own = slice(start, start + fragment.size)
        states.append(GlobalState(theta[own], full.outer.lr, full.outer.momentum, storage=(theta[own], momentum[own])))
        start = own.stop
    return states


class Streams:
    """One peer's P fragments over one trainer. `merger_for(i, clock, state)`: fragment i's merger (its own
    rounds, islands and records: a swarm's fragment i is a swarm of its own), timed by the fragment's own round
    clock, over its part of the global state. `state`, a global state at version 0, hands its vectors over to the
    fragments' (`fragment_states`)."""

    def __init__(self, trainer: InnerTrainer, state: GlobalState,
                 merger_for: Callable[[int, RoundClock, GlobalState], Merger],
                 stagger: Stagger, peer: str, name: str, **diloco_options):
        if trainer.cfg.fsdp:
            raise ValueError("fragments: not with a model sharded over ranks (--fsdp)")
        self.trainer, self.stagger = trainer, stagger
        self.fragments = model_fragments(trainer.model, stagger.fragments)
        self.parts = []
        for f, part in zip(self.fragments, fragment_states(state, self.fragments)):
            clock = RoundClock()
            self.parts.append(DiLoCo(FragmentTrainer(trainer, f), part, merger_for(f.index, clock, part), peer, name,
                                     clock=clock, **diloco_options))
        self.left_at: list[Optional[int]] = [None] * len(self.parts)  # the step count when each last contributed
        self.started_at = trainer.total_steps

    # ---- inner steps --------------------------------------------------------------------------------------
    @property
    def swarm_tokens(self) -> int:
        """The fragments' own progress (merged and unmerged tokens), averaged: what a checkpoint records."""
        return sum(part.swarm_tokens for part in self.parts) // len(self.parts)

    @property
    def schedule_tokens(self) -> int:
        """The lr schedule's clock (`DiLoCo.schedule_tokens`), the fragments' averaged."""
        return sum(part.schedule_tokens for part in self.parts) // len(self.parts)

    def inner_step(self) -> tuple[torch.Tensor, float]:
        loss, seconds = self.trainer.timed_step(self.schedule_tokens)
        for part in self.parts:
            part.count_step(seconds, share=1.0 / len(self.parts))
        return loss, seconds

    # ---- rounds -------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> list[int]:
        return [i for i, part in enumerate(self.parts) if part.in_flight is not None]

    def due(self, allowed: Callable[[int], bool] = lambda i: True,
            looking: Callable[[int], bool] = lambda i: False) -> list[int]:
        """The fragments whose rounds should leave now, τ in flight at most: the longest overdue first (in
        fragment order among equals), so that a fragment held back by τ is not passed over by the others'
        next rounds; then those whose peers are `looking(i)` for an island for them, with half a round of steps
        to give (`Stagger.joins_early`: a peer out of phase falls back in). `allowed(i)`: whether fragment i may
        contribute at all now."""
        overdue = []
        for i, part in enumerate(self.parts):
            if part.in_flight is None and allowed(i):
                since = self.trainer.total_steps - self._since(i)
                late = self.stagger.overdue(i, since, self.left_at[i] is not None)
                if late >= 0:
                    overdue.append((-late, i))
                elif self.stagger.joins_early(since) and looking(i):
                    overdue.append((1, i))
        room = self.stagger.in_flight - len(self.in_flight)
        return [i for _, i in sorted(overdue)[:max(0, room)]]

    def _since(self, i: int) -> int:
        return self.started_at if self.left_at[i] is None else self.left_at[i]

    def contribute(self, i: int) -> None:
        self.parts[i].contribute()
        self.left_at[i] = self.trainer.total_steps

    def poll(self) -> list[tuple[int, Settled]]:
        """The outcomes that arrived, applied (never blocks)."""
        settled = [(i, part.poll()) for i, part in enumerate(self.parts)]
        return [(i, s) for i, s in settled if s is not None]

    def unsent(self) -> list[int]:
        """The fragments holding unmerged steps with no round in flight (what a run's end still has to send)."""
        return [i for i, part in enumerate(self.parts) if part.in_flight is None and part.unmerged_steps]

    def wait(self, i: int, timeout: Optional[float] = None) -> Optional[Settled]:
        return self.parts[i].wait(timeout)

    # ---- the whole model ----------------------------------------------------------------------------------
    def global_params(self) -> torch.Tensor:
        """Θ whole, in the model's flat layout, from the fragments' parts (each at its own version)."""
        out = torch.empty(sum(f.size for f in self.fragments), dtype=torch.float32)
        for fragment, part in zip(self.fragments, self.parts):
            for piece, own in fragment.slices():
                out[piece.flat] = part.state.params[own]
        return out

    def _in_layout(self, vector_of: Callable[[DiLoCo], torch.Tensor]) -> list[torch.Tensor]:
        """Every fragment's pieces of one of its vectors, in the model's flat layout: that vector of the whole
        model, as views (concatenated, they are Θ or the momentum in the layout of P = 1)."""
        pieces = [(piece.flat.start, vector_of(part)[own])
                  for fragment, part in zip(self.fragments, self.parts) for piece, own in fragment.slices()]
        return [t for _, t in sorted(pieces, key=lambda x: x[0])]

    @property
    def versions(self) -> list[int]:
        return [part.state.version for part in self.parts]

    def close(self) -> None:
        for part in self.parts:
            part.close()

    # ---- resuming ---------------------------------------------------------------------------------------
    @property
    def can_checkpoint(self) -> bool:
        return all(part.can_checkpoint for part in self.parts)

    def checkpoint_guard(self) -> Callable[[], ContextManager]:
        """Every fragment's guard at once: a background checkpoint's Θ is refused if any fragment's changed."""
        guards = [part.checkpoint_guard() for part in self.parts]

        @contextlib.contextmanager
        def held():
            with contextlib.ExitStack() as stack:
                for guard in guards:
                    stack.enter_context(guard())
                yield
        return held

    def checkpoint_state(self) -> tuple[dict, dict[str, Entry]]:
        """A checkpoint in the format of P = 1 (`training.checkpoint`): Θ and the momentum whole in the model's
        layout, written from the fragments' own vectors without a copy, so `export` and `sample` read it as
        any other. Each fragment's version, lineage and counters go in `meta["fragments"]`; the top-level
        version is their sum (it grows with every fragment's round: the checkpoints' order)."""
        assert self.can_checkpoint, "an eager peer checkpoints between rounds only"
        theta = self._in_layout(lambda part: part.state.params)
        momentum = self._in_layout(lambda part: part.state.outer.momentum_buffer)
        meta = dict(version=sum(self.versions), digest=digest(*theta, *momentum), history=[], last_members=[],
                    tokens=self.swarm_tokens,
                    fragments=dict(count=len(self.parts), rule=RULE, h=self.stagger.h,
                                   parts=[dict(part.rounds_checkpoint(), left_at=left)
                                          for part, left in zip(self.parts, self.left_at)]))
        tensors: dict[str, Entry] = {"global": Concatenated(theta), "momentum": Concatenated(momentum)}
        trainer_meta, trainer_tensors = trainer_checkpoint(self.trainer)
        meta.update(trainer_meta)
        tensors.update(trainer_tensors)
        return meta, tensors

    def restore_checkpoint_state(self, meta: dict, tensors: dict[str, torch.Tensor],
                                 contributed: Optional[dict[int, dict]] = None) -> Optional[str]:
        """Resume from `checkpoint_state`'s checkpoint; CheckpointError if it was split otherwise (another P, rule
        or H) or a fragment's part does not hash to its recorded digest. `contributed`: each fragment's newest
        contribution as noted when it left (DiLoCo.restore_checkpoint_state)."""
        saved = meta.get("fragments")
        ours = dict(count=len(self.parts), rule=RULE, h=self.stagger.h)
        if not isinstance(saved, dict) or {k: saved.get(k) for k in ours} != ours \
                or not isinstance(saved.get("parts"), list) or len(saved["parts"]) != len(self.parts):
            theirs = {k: saved.get(k) for k in ours} if isinstance(saved, dict) else "a whole model's (no fragments)"
            raise CheckpointError(f"the checkpoint's fragments are {theirs}, this run's {ours}: start it with "
                                  "the settings it was saved with, or from another folder")
        note = restore_trainer(self.trainer, meta, tensors)
        for i, (fragment, part, rounds) in enumerate(zip(self.fragments, self.parts, saved["parts"])):
            state = [torch.cat([tensors[key][piece.flat] for piece in fragment.pieces])
                     for key in ("global", "momentum")]
            part.restore_rounds(rounds, state, (contributed or {}).get(i))
            if part.state.digest != rounds.get("digest"):
                raise CheckpointError(f"fragment {i}: its part of the global state does not match its digest")
            self.left_at[i] = rounds.get("left_at")
        return note


def train_streams(streams: Streams, should_leave: Callable[[], bool],
                  on_step: Callable[[torch.Tensor, float], None] = lambda loss, seconds: None,
                  on_round: Callable[[int, Settled], None] = lambda i, s: None,
                  final_wait: Callable[[], float] = lambda: 120.0,
                  on_contribute: Callable[[int, Contribution], None] = lambda i, c: None,
                  ready: Callable[[int], bool] = lambda i: True,
                  looking: Callable[[int], bool] = lambda i: False) -> None:
    """`training.diloco.train` for fragments: inner steps until `should_leave()`, each fragment's round leaving
    when the stagger says, or early where others are `looking(i)` for an island for it (`Streams.due`), and
    `ready(i)` (a restarted peer contributes once it has joined; a fragment that has
    done its rounds stops, rather than look for an island its peers, done too, have left), outcomes applied
    between steps as they arrive; at the end, the rounds in flight may finish within `final_wait()`, and are
    abandoned otherwise (their steps stay unmerged)."""
    while not should_leave():
        for i in streams.due(ready, looking):
            streams.contribute(i)
            on_contribute(i, streams.parts[i].in_flight.contribution)
        loss, seconds = streams.inner_step()
        on_step(loss, seconds)
        for i, settled in streams.poll():
            on_round(i, settled)
    for i in streams.in_flight:  # let the rounds finish: abandoning one costs its island a retry
        try:
            on_round(i, streams.wait(i, timeout=final_wait()))
        except TimeoutError:
            streams.parts[i].abandon()
