"""Who in a formed island is merged, how much each counts, and on what scales: decided alike by every member
from the gathered records, so all of them encode with the same weights and scales and agree on one deadline.

Nothing a member claims is taken at face value (volunteers are strangers):
- its merge weight is capped at `weight_ratio` × the island's median weight, so claiming 1000× the tokens it
  trained buys it at most that multiple of a typical member's say;
- its block statistics (the maxima the group's quantization scales come from) are clipped per block to
  `scale_ratio` × the island's median, so one member cannot set scales so coarse that everyone else's
  pseudo-gradient rounds to zero. Every sender's codes are clamped to the agreed range, and reducers refuse
  codes beyond it: whatever a member sends, it moves each value by at most its capped weight's share of the
  clipped scale;
- its weight is cut further where the norm of its pseudo-gradient (the sum of its claimed block norms) stands
  above `norm_ratio` × the island's median, so the vector it adds is bounded too, not only each value, and where
  its weight times that norm stands above `influence_ratio` × the island's median product. What a member cut for
  too long a Δ loses goes to nobody: the merge is the mean of the members' Δs with the long ones clipped
  (`share_of_the_shortened`), not a mean that gives the others more say for every member cut.

A member whose Δ was taken from an older global state than the one the merge is applied to (the newest member's)
keeps `stale_factor` of its weight per version it is behind, and the weights are not renormalised: the merge is
that much shorter. Such a Δ is late by the versions between, and usually long too: a member falls behind when its
round failed while others merged, so its Δ carries that round's steps as well, and tokens²/steps gives it twice the
weight for them. Merged at full weight, an island of such members stepped twice the usual length, and Nesterov
momentum carried the overshoot on (docs/hardware.md). Age-scaled pseudo-gradients are CGAD's answer to the same
instability (arXiv 2605.09126); 0.5 per version gives back a one-round-late member the weight of one round. A
peer's default is 0.5 (config.OuterConfig): with one learner 3× slower, its late Δ merged at full weight left the
loss where it was, and at 0.5 the loss fell 4-5 % (docs/parity.md); where staleness came from failed rounds, 0.5
was within ±0.5 % either way.
Whoever reduces a part then checks each sender's codes against its claims (p2pdiloco.core.claims): a member
cannot claim modest statistics and send more.
The median is the lower one: with two members, an outlier is bounded by the other, not by their average.

A member that failed a round (its sum never came, or its part came malformed or beyond its claims) is blamed by
those it failed. A part that comes after its reducer's cut-off is left out of that piece only: on a slow link that
happens to honest volunteers, so only a member late again soon after is blamed (Stragglers). Each member gathers
whom it blames (its PenaltyBox); a member blamed by more than half of the others is left out of the merge: it
neither sends nor reduces a part. A hostile minority cannot leave out an honest member.
A member blamed by any one other is still merged but reduces no part (it is relieved): a reducer that fails costs
the whole island its round, a sender that fails only its own part. Without this, a peer that failed one member
could fail it again in the next island they met, whoever led it, as long as the others there did not blame it
yet. A blame list naming more than half of the others relieves nobody, so a liar blaming everyone cannot take
all the parts to itself; a member left out blames no one; and if every dialable member would be relieved, none is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from p2pdiloco.core.exact import n_blocks
from p2pdiloco.core.outer import merge_weights
from p2pdiloco.protocol.remote import MAX_BLAME, Island
from p2pdiloco.protocol.timing import agreed_deadline


@dataclass(frozen=True)
class Bounds:
    """How far one member may stand out from its island (0: no bound). The same on every peer of a swarm."""

    weight_ratio: float = 2.0
    scale_ratio: float = 2.0
    norm_ratio: float = 2.0
    stale_factor: float = 1.0  # what a member's weight keeps per version it is behind the newest member (1: all)
    influence_ratio: float = 0.0  # weight × Δ norm at most this multiple of the island's median (0: no bound)
    floor_ratio: float = 0.0  # weight cut where Δ's norm is below the island's upper median over this (0: no cut)

    @classmethod
    def of(cls, outer) -> "Bounds":
        """A swarm's bounds from its outer configuration (config.OuterConfig): the peer's and the simulator's."""
        return cls(outer.max_weight_ratio, outer.max_scale_ratio, outer.max_norm_ratio, outer.stale_factor,
                   outer.max_influence_ratio, outer.min_norm_ratio)


@dataclass
class PenaltyBox:
    """Whom this peer blames, and until when (seconds on the caller's clock)."""

    seconds: float = 600.0
    until: dict = field(default_factory=dict)

    def blame(self, peers, now: float) -> None:
        for peer in peers:
            self.until[peer] = now + self.seconds

    def active(self, now: float) -> list[str]:
        self.until = {p: t for p, t in self.until.items() if t > now}
        return sorted(self.until, key=self.until.get, reverse=True)[:MAX_BLAME]


@dataclass
class Stragglers:
    """Members whose part came after our cut-off (seconds on the caller's clock). Late once is left out of that
    piece and not blamed: a busy CPU or a burst on a home uplink does it to honest peers, and blame would keep them
    out of islands for minutes. Late again within `window` is blamed: a member that keeps withholding its part
    costs every round it joins the wait for it."""

    window: float = 600.0
    last: dict = field(default_factory=dict)  # member → when it was last late

    def late(self, peers, now: float) -> frozenset:
        """Note these members as late now; those of them that were late within the window before."""
        self.last = {p: t for p, t in self.last.items() if t > now - self.window}
        again = frozenset(p for p in peers if p in self.last)
        self.last.update({p: now for p in peers})
        return again


@dataclass(frozen=True)
class IslandPlan:
    weights: Optional[list[float]]  # one per group member, 0 for the excluded; None: nothing to merge
    deadline: float  # the all-reduce deadline, seconds
    reason: str = ""  # why there is nothing to merge
    maxabs: list = field(default_factory=list)  # per member: its block statistics, clipped (zeros if excluded)
    clipped: list = field(default_factory=list)  # per member: which of its block statistics were clipped
    norms: list = field(default_factory=list)  # per member: its claimed block norms (zeros if excluded)
    backing: list = field(default_factory=list)  # per member, per block: its clipped statistic over its claimed
    # one (1 where not clipped): how much of its claimed norm its codes must carry (p2pdiloco.core.claims)
    bounded: dict = field(default_factory=dict)  # member index → what was capped, for the logs
    left_out: dict = field(default_factory=dict)  # member index → why (blamed by most others)
    relieved: dict = field(default_factory=dict)  # member index → why it reduces no part (blamed by one other)
    clients: frozenset = frozenset()  # member indices in client mode: they accept no connections
    nodes: tuple = ()  # member indices of the reducer nodes that reduce a part (they contribute nothing)
    tokens: int = 0  # what the merge adds to Θ's token count, the swarm's clock (`counted_tokens`)

    @property
    def included(self) -> list[int]:
        """The members whose contribution is merged (the others' parts are not summed)."""
        return [i for i, w in enumerate(self.weights or []) if w > 0]

    @property
    def reducers(self) -> list[int]:
        """The members that reduce a part of the all-reduce, in the group's order: the included members others
        can dial, less the relieved ones unless no other is left, and the reducer nodes."""
        dialable = [i for i in self.included if i not in self.clients]
        trusted = [i for i in dialable if i not in self.relieved] or ([] if self.nodes else dialable)
        return sorted([*trusted, *self.nodes])


NO_REDUCER = ("every merged member is in client mode and no reducer node is in the group: none can reduce a part "
              "(a public peer, or `p2pdiloco bootstrap --reduce` on a public machine, can)")


def plan_island(island: Island, weighting: str, cap: float, n_params: int, bounds: Bounds = Bounds(),
                clients: frozenset = frozenset()) -> IslandPlan:
    """`clients`: the indices of members in client mode (behind a NAT: nobody can dial them). The island's
    reducer nodes (`island.nodes`) reduce parts and contribute nothing; one blamed by a contributor reduces
    none, unless every node is."""
    plan = _plan(island, weighting, cap, n_params, bounds)
    plan = dataclasses.replace(plan, clients=frozenset(clients))
    if island.nodes and plan.weights is not None:
        if len(plan.included) < 2:
            return IslandPlan(None, plan.deadline, "one contributor and a reducer node: nothing to merge",
                              left_out=plan.left_out, clients=plan.clients)
        blamed = nodes_blamed(island, plan.included)
        trusted = sorted(set(island.nodes) - set(blamed))
        dialable = [i for i in plan.included if i not in plan.clients]
        plan = dataclasses.replace(plan, nodes=tuple(trusted or ([] if dialable else sorted(island.nodes))),
                                   relieved={**plan.relieved, **blamed})
    if plan.weights is not None and not plan.reducers:
        return IslandPlan(None, plan.deadline, NO_REDUCER, left_out=plan.left_out, clients=plan.clients)
    return plan


def nodes_blamed(island: Island, contributors: list[int]) -> dict[int, str]:
    """Reducer node index → who blames it, for the nodes that a merged contributor blames (its part or sum
    failed that member lately)."""
    out = {}
    for i, node in island.nodes.items():
        blamers = [m.name or m.peer[-6:] for m in (island.members[j] for j in contributors) if node.peer in m.blame]
        if blamers:
            out[i] = f"blamed by {', '.join(blamers)}: reduces no part"
    return out


def _plan(island: Island, weighting: str, cap: float, n_params: int, bounds: Bounds) -> IslandPlan:
    deadline = agreed_deadline([m.budget for m in island.accepted], cap)
    left_out = blamed_by_majority(island)
    if left_out:  # (the plan says why in `left_out`; the parser's reasons stay as they were)
        island = dataclasses.replace(island, members=tuple(None if i in left_out else m
                                                           for i, m in enumerate(island.members)))
    relieved = blamed_by_a_few(island)  # by those still in: a left-out member's blame counts no more
    accepted = island.accepted
    if not accepted:
        return IslandPlan(None, deadline, "no member's record was well-formed, or every member was blamed",
                          left_out=left_out)
    norms = [_fp32(m.block_norms) for m in accepted]
    stats = [_fp32(m.maxabs) for m in accepted]
    clipped, over = clip_to_block_median(stats, bounds.scale_ratio)
    backing = [torch.where(o, c / s.clamp_min(1e-30), 1.0) for c, s, o in zip(clipped, stats, over)]
    try:
        capped, weight_notes = member_weights([m.tokens for m in accepted], [m.steps for m in accepted],
                                              [m.delta_norm or 0.0 for m in accepted], [m.version for m in accepted],
                                              weighting, bounds, backed_norms(norms, backing))
    except ValueError as e:  # no tokens at all
        return IslandPlan(None, deadline, str(e), left_out=left_out)
    index = [i for i, m in enumerate(island.members) if m is not None]
    notes: dict[int, str] = {}
    for k, why in [*weight_notes,
                   *((k, f"{int(o.sum())} block maxima clipped") for k, o in enumerate(over) if o.any())]:
        notes[index[k]] = "; ".join(filter(None, [notes.get(index[k]), why]))
    nothing = torch.zeros(n_blocks(n_params))
    tokens = counted_tokens([m.tokens for m in accepted], [w > 0 for w in capped], bounds.weight_ratio)
    return IslandPlan(_spread(capped, index, len(island.members), 0.0), deadline, tokens=tokens,
                      maxabs=_spread(clipped, index, len(island.members), nothing),
                      clipped=_spread(over, index, len(island.members), nothing.bool()),
                      norms=_spread(norms, index, len(island.members), nothing),
                      backing=_spread(backing, index, len(island.members), nothing), bounded=notes, left_out=left_out,
                      relieved=relieved)


def member_weights(tokens: list[int], steps: list[int], norms: list[float], versions: list[int], weighting: str,
                   bounds: Bounds, backed: Optional[list[float]] = None) -> tuple[list[float], list[tuple[int, str]]]:
    """The merge weights of an island's accepted members from what they claim, and (member, what was bounded)
    notes: token weighting, capped at the median, cut where a norm stands out or falls short (`backed`: the norms
    their codes must carry, where their block maxima were clipped; their claimed norms by default; what a member cut
    for a long Δ loses goes to nobody), discounted where stale. Raises ValueError where no member trained a token."""
    weights = merge_weights(tokens, steps, weighting)
    capped_weights, capped = cap_to_median(weights, bounds.weight_ratio)
    weights, cut = cut_to_median_norm(capped_weights, norms, bounds.norm_ratio)
    weights, floored = cut_below_median_norm(weights, norms if backed is None else backed, bounds.floor_ratio)
    weights, bounded = cap_influence(weights, norms, bounds.influence_ratio)
    weights = share_of_the_shortened(capped_weights, weights, norms, {*cut, *bounded})
    weights, discounted = discount_stale(weights, versions, bounds.stale_factor)
    return weights, [*capped.items(), *cut.items(), *floored.items(), *bounded.items(), *discounted.items()]


def counted_tokens(tokens: list[int], merged: list[bool], ratio: float) -> int:
    """The tokens a merge adds to Θ's count, which the learning-rate schedule runs by: each merged member's, at most
    `ratio` × the island's lower median (0: no cap), as its weight is capped. Counted as claimed, one liar claiming
    1000× its tokens would end every peer's warm-up in one round, and run every schedule as if it had trained them."""
    bound = ratio * lower_median([t for t in tokens if t > 0] or [0]) if ratio > 0 else None
    return sum(t if bound is None else min(t, int(bound)) for t, m in zip(tokens, merged) if m)


def backed_norms(norms: list[torch.Tensor], backing: list[torch.Tensor]) -> list[float]:
    """Each member's claimed norm as far as its codes must carry it: its block norms times its backing (a clipped
    block's codes may be clamped, so only that share of its norm is held to; p2pdiloco.core.claims). A liar that
    claims maxima far above the island's, to escape the floor's check, backs its norm that much less."""
    return [float((n.double() * b.double()).square().sum().sqrt()) for n, b in zip(norms, backing)]


def _fp32(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.float32)


def _spread(values: list, index: list[int], size: int, missing) -> list:
    """Per accepted member → per group member, `missing` where a member is not accepted."""
    out = [missing] * size
    for i, value in zip(index, values):
        out[i] = value
    return out


def blamed_by_majority(island: Island) -> dict[int, str]:
    """Member index → why, for the members that more than half of the other well-formed members blame."""
    accepted = [(i, m) for i, m in enumerate(island.members) if m is not None]
    out = {}
    for i, m in accepted:
        blamers = sum(m.peer in other.blame for j, other in accepted if j != i)
        if blamers and 2 * blamers > len(accepted) - 1:
            out[i] = f"blamed by {blamers} of the {len(accepted) - 1} others for a failed round"
    return out


def blamed_by_a_few(island: Island) -> dict[int, str]:
    """Member index → who blames it, for the members that another well-formed member blames, counting only blame
    lists that name at most half of the lister's others (a longer one is a liar's, or a peer failed by most of its
    island: either way it says little about any one member)."""
    accepted = [(i, m) for i, m in enumerate(island.members) if m is not None]
    peers = {m.peer for _, m in accepted}
    credible = [(j, m) for j, m in accepted if 2 * len((m.blame & peers) - {m.peer}) <= len(accepted) - 1]
    out = {}
    for i, m in accepted:
        blamers = [other.name or other.peer[-6:] for j, other in credible if j != i and m.peer in other.blame]
        if blamers:
            out[i] = f"blamed by {', '.join(blamers)}: reduces no part"
    return out


def cap_influence(weights: list[float], norms: list[float], ratio: float) -> tuple[list[float], dict[int, str]]:
    """Weights, each member's cut so that what it adds to the merge, its weight times its Δ's norm, is at most
    `ratio` × the island's lower median of that product; not renormalised (`share_of_the_shortened` does). The
    weight cap and the norm cut bound each factor alone, so together they let a member add their product (4× a
    typical member's at 2 and 2); this bounds the product. Members with a zero norm add nothing and count in no
    median. The bound is relative to a median, so dividing every weight alike afterwards keeps it."""
    products = [w * n for w, n in zip(weights, norms)]
    return _cut_to_median(weights, products, ratio, lambda f: f"weight cut to {f:.2g}× (weight × Δ norm "
                          f"{1 / f:.2g}× the bound of {ratio:g}× the island's median)")


def share_of_the_shortened(before: list[float], weights: list[float], norms: list[float],
                           shortened: set) -> list[float]:
    """`weights` (`before`, normalised, after the cuts for a Δ's length) divided by what they would sum to had each
    member cut for too long a Δ (`shortened`) weighed its weight `before`, up to a typical member's (the lower median
    weight of those with a positive norm): what such a member lost goes to nobody, while what a member floored for
    too short a Δ lost goes to the others (a near-zero Δ claiming full weight must not shorten the merge). With
    nobody shortened, that is renormalising to 1.
    Renormalising to 1 instead gave a ×100 liar's cut share to the honest members: the honest part of the merge
    kept its whole length and the liar's bounded vector came on top, 4/3 of a clean step with one such liar in 4
    and 3/2 with a pair in 6 (docs/hostile.md). Every weight is divided alike, so the bounds, relative to the
    island's medians, still hold."""
    typical = lower_median([w for w, n in zip(before, norms) if n > 0] or [0.0])
    total = sum(min(b, typical) if k in shortened else w for k, (b, w) in enumerate(zip(before, weights)))
    return [w / total for w in weights] if total > 0 else weights


def _cut_to_median(weights: list[float], values: list[float], ratio: float,
                   why: Callable[[float], str]) -> tuple[list[float], dict[int, str]]:
    """Weights, each member's times min(1, `ratio` × the lower median of the positive `values` / its value), not
    renormalised; (member, `why(factor)`) for those cut. Nothing is cut with fewer than two positive values: a
    bound from one member's own value never binds it."""
    positive = [x for x in values if x > 0]
    if ratio <= 0 or len(positive) < 2:
        return weights, {}
    bound = ratio * lower_median(positive)
    factors = [min(1.0, bound / x) if x > 0 else 1.0 for x in values]
    if all(f == 1.0 for f in factors):
        return weights, {}
    return [w * f for w, f in zip(weights, factors)], {k: why(f) for k, f in enumerate(factors) if f < 1.0}


def lower_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def cap_to_median(weights: list[float], ratio: float) -> tuple[list[float], dict[int, str]]:
    """Normalised weights with none above `ratio` × the lower median, renormalised (which can push another
    weight over the bound again: repeated until none is, at most once per member)."""
    if ratio <= 0 or len(weights) < 2:
        return weights, {}
    weights, notes = list(weights), {}
    for _ in weights:
        bound = ratio * lower_median([w for w in weights if w > 0] or [0.0])
        over = [k for k, w in enumerate(weights) if w > bound * (1 + 1e-12)]
        if not over or bound <= 0:
            break
        for k in over:
            notes[k] = f"merge weight capped at {ratio:g}× the island's median"
            weights[k] = bound
        total = sum(weights)
        weights = [w / total for w in weights]
    return weights, notes


def cut_to_median_norm(weights: list[float], norms: list[float], ratio: float) -> tuple[list[float], dict[int, str]]:
    """Weights, each member's multiplied by min(1, `ratio` × lower median norm / its norm), not renormalised: what
    it adds to the merge is at most `ratio` times a typical member's Δ at its weight, however large the Δ it claims.
    An honest member with a large Δ (it trained longer, or from an older version) counts less, but is merged."""
    return _cut_to_median(weights, norms, ratio, lambda f: f"weight cut to {f:.2g}× (its Δ's norm is {1 / f:.2g}× "
                          f"the bound of {ratio:g}× the island's median)")


def cut_below_median_norm(weights: list[float], norms: list[float], ratio: float) -> tuple[list[float],
                                                                                       dict[int, str]]:
    """Weights, each member's multiplied by min(1, its norm × `ratio` / the island's upper median norm), not
    renormalised (`share_of_the_shortened` gives what it lost to the others): a member that claims full tokens for
    a near-zero Δ (dilution: it would take weight from the others and shorten the merge for free) counts as little
    as its Δ is long. The upper median, so that a minority of tiny claims cannot lower the floor (the lower median
    bounds the large ones). An honest member with a short window counts less, as its tokens already say. Reducers hold the codes to at least the claimed
    norm (p2pdiloco.core.claims), so a liar cannot claim a typical norm and send nothing."""
    positive = [x for x in norms if x > 0]
    if ratio <= 0 or len(positive) < 2:
        return weights, {}
    floor = sorted(positive)[len(positive) // 2] / ratio
    factors = [min(1.0, max(x, 0.0) / floor) for x in norms]
    cut = [w * f for w, f in zip(weights, factors)]
    if all(f == 1.0 for f in factors) or sum(cut) <= 0:
        return weights, {}
    return cut, {k: f"weight cut to {f:.2g}× (its Δ's norm is {f:.2g}× the floor of the "
                                         f"island's median over {ratio:g})" for k, f in enumerate(factors) if f < 1}


def discount_stale(weights: list[float], versions: list[int], factor: float) -> tuple[list[float], dict[int, str]]:
    """Each weight times `factor` to the power of the versions its member is behind the newest, not renormalised
    (the module's docstring says why)."""
    newest = max(versions, default=0)
    behind = [newest - v for v in versions]
    if factor >= 1.0 or not any(behind):
        return weights, {}
    notes = {k: f"weight × {factor ** b:.3g}: {b} version{'s' if b > 1 else ''} behind" for k, b in enumerate(behind) if b}
    return [w * factor ** b for w, b in zip(weights, behind)], notes


def clip_to_block_median(stats: list[torch.Tensor], ratio: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each member's per-block statistic clipped to `ratio` × the lower median across members, per block, and
    per member which blocks were clipped."""
    if ratio <= 0 or len(stats) < 2:
        return stats, [torch.zeros(s.numel(), dtype=torch.bool) for s in stats]
    stacked = torch.stack(stats)  # (members, blocks)
    bound = stacked.sort(dim=0).values[(len(stats) - 1) // 2] * ratio  # lower_median, per block
    return list(torch.minimum(stacked, bound)), list(stacked > bound)
