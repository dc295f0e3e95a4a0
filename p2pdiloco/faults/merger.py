"""Faults of the round's driver: a liar's wire and claims, and a partition into two islands."""

from __future__ import annotations

import math

import torch

from p2pdiloco.faults.lies import CONSISTENT_LIES, Liar
from p2pdiloco.faults.plan import FaultPlan
from p2pdiloco.protocol.outcomes import Contribution
from p2pdiloco.protocol.remote import MAX_VERSION
from p2pdiloco.swarm.rounds import SwarmMerger


class FaultyMerger(SwarmMerger):
    """`hostile_scaled`, `hostile_random`, `hostile_nan`, the liars whose claims are true of their lie
    (`hostile_claimed` and the others of p2pdiloco.faults.lies) and `partition_until` (p2pdiloco.faults.plan)."""

    def __init__(self, plan: FaultPlan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan
        lies = [(plan.version_of(a), a) for a in CONSISTENT_LIES if plan.version_of(a) is not None]
        self.liar = (min(lies)[0], Liar(min(lies)[1])) if lies else None  # (from which version, who)

    def _group_bits(self, version: int) -> str:
        until = self.plan.version_of("partition_until")
        return "1" if until is not None and version < until else ""

    def _island(self, c: Contribution, island):
        if self._group_bits(c.version) != self._group_bits(0):
            self.averager.set_group_bits(self._group_bits(c.version))
        return super()._island(c, island)

    def _load_buffer(self, c: Contribution, island) -> dict:
        """The lie goes on the wire; the record keeps the statistics of the honest Δ (so they look plausible),
        except for the liars of p2pdiloco.faults.lies, whose records are measured on their lie."""
        if self.liar is not None and c.version >= self.liar[0]:
            sent, tokens = self.liar[1].lie(c.delta, c.tokens)
            lie = Contribution.of(sent, tokens=tokens, steps=c.steps, version=c.version, peer=c.peer, name=c.name,
                                  digest=c.digest, seconds=c.seconds)
            return super()._load_buffer(lie, island)
        record = super()._load_buffer(c, island)
        with self.averager.buffer() as buffer:
            body = buffer[: self.n]
            sent, record["tokens"] = hostile(self.plan, body, c)
            if sent is not body:
                body.copy_(sent)
        return record


def hostile(plan: FaultPlan, body: torch.Tensor, c: Contribution) -> tuple[torch.Tensor, int]:
    """What a hostile peer sends instead of its Δ, and the tokens it claims, from the plan's version on."""
    def on(action: str) -> bool:
        at = plan.version_of(action)
        return at is not None and c.version >= at

    if on("hostile_scaled"):
        return body * 100, min(c.tokens * 1000, MAX_VERSION)
    if on("hostile_random"):  # noise of the same spread as its Δ
        return torch.randn_like(body) * body.std(), min(c.tokens * 1000, MAX_VERSION)
    if on("hostile_nan"):
        return torch.full_like(body, math.nan), c.tokens
    return body, c.tokens
