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

from typing import Callable, Iterator, Optional

import torch

from p2pdiloco.core.fragments import Fragment, Stagger, split
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.training.diloco import DiLoCo, Merger, Settled
from p2pdiloco.training.inner import InnerTrainer, param_slices


def model_fragments(model: torch.nn.Module, p: int) -> tuple[Fragment, ...]:
    """The model's P fragments, by the split every peer computes alike (core.fragments.RULE)."""
    return split([(name, tuple(param.shape)) for name, param, _ in param_slices(model)], p)


class FragmentView:
    """A fragment of a model, as `param_slices` and the flat-vector helpers read a model: its pieces in layout
    order, each a flat view of the rows it holds (detached: written in place, outside autograd)."""

    def __init__(self, model: torch.nn.Module, fragment: Fragment):
        self.model, self.fragment = model, fragment

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self.model.named_parameters())
        for piece in self.fragment.pieces:
            param = params[piece.name].detach()
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
    def batches(self):
        return self.trainer.batches

    def theta_written(self) -> None:
        self.trainer.theta_written()

    def timed_step(self, progress: Optional[int] = None):
        raise RuntimeError("a fragment does not step alone: Streams.inner_step steps the model once for all")


def fragment_state(full: GlobalState, fragment: Fragment) -> GlobalState:
    """A fragment's part of a global state (at its version 0: where every fragment starts)."""
    params = torch.cat([full.params[piece.flat] for piece in fragment.pieces])
    return GlobalState(params, full.outer.lr, full.outer.momentum)


class Streams:
    """One peer's P fragments over one trainer. `merger_for(i, clock)`: fragment i's merger (its own rounds,
    islands and records: a swarm's fragment i is a swarm of its own), timed by the fragment's own round clock."""

    def __init__(self, trainer: InnerTrainer, state: GlobalState,
                 merger_for: Callable[[int, RoundClock], Merger],
                 stagger: Stagger, peer: str, name: str, **diloco_options):
        if trainer.cfg.fsdp:
            raise ValueError("fragments: not with a model sharded over ranks (--fsdp)")
        self.trainer, self.stagger = trainer, stagger
        self.fragments = model_fragments(trainer.model, stagger.fragments)
        self.parts = []
        for f in self.fragments:
            clock = RoundClock()
            self.parts.append(DiLoCo(FragmentTrainer(trainer, f), fragment_state(state, f), merger_for(f.index, clock),
                                     peer, name, clock=clock, **diloco_options))
        self.left_at: list[Optional[int]] = [None] * len(self.parts)  # the step count when each last contributed
        self.started_at = trainer.total_steps

    # ---- inner steps --------------------------------------------------------------------------------------
    @property
    def swarm_tokens(self) -> int:
        """The schedule's clock: the fragments' own clocks (merged and unmerged tokens), averaged."""
        return sum(part.swarm_tokens for part in self.parts) // len(self.parts)

    def inner_step(self) -> tuple[torch.Tensor, float]:
        loss, seconds = self.trainer.timed_step(self.swarm_tokens)
        for part in self.parts:
            part.count_step(seconds, share=1.0 / len(self.parts))
        return loss, seconds

    # ---- rounds -------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> list[int]:
        return [i for i, part in enumerate(self.parts) if part.in_flight is not None]

    def due(self) -> list[int]:
        """The fragments whose rounds should leave now, in fragment order, τ in flight at most."""
        room = self.stagger.in_flight - len(self.in_flight)
        due = []
        for i, part in enumerate(self.parts):
            if part.in_flight is None and len(due) < room:
                since = self.trainer.total_steps - (self.started_at if self.left_at[i] is None else self.left_at[i])
                if self.stagger.due(i, since, self.left_at[i] is not None):
                    due.append(i)
        return due

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

    @property
    def versions(self) -> list[int]:
        return [part.state.version for part in self.parts]

    def close(self) -> None:
        for part in self.parts:
            part.close()
