"""The contract between the DiLoCo loop and whatever merges contributions: what goes in, and the typed outcome
that comes back. One type per way a round can end, each carrying what was decided (the grace window, the
deadline, the weights, the reason), so metrics log the outcome as it is and never recompute it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Protocol

import torch

from p2pdiloco.core.exact import chunks
from p2pdiloco.protocol.remote import Member
from p2pdiloco.runtime.paging import LetGo, hold

StateTuple = tuple[dict, list[torch.Tensor]]  # (metadata with version and digest, [Θ, outer momentum])


class Parts(Protocol):
    """A flat fp32 vector read a slice at a time: a tensor is one."""

    def __getitem__(self, part: slice) -> torch.Tensor: ...

    def numel(self) -> int: ...




def copy_parts(source: Parts, out: torch.Tensor) -> None:
    """out ← source, a chunk at a time."""
    for part in chunks(out.numel(), 1 << 20):  # 4 MB of fp32
        out[part] = source[part]


class Kept:
    """A contribution's Δ, held until dropped. Its host may let the tensor go once it is safely elsewhere
    (p2pdiloco.training.spill writes it to disk while the round runs); `get` then reads it back."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor: Optional[torch.Tensor] = tensor

    def get(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError("this contribution was dropped")
        return self._tensor

    def parts(self) -> "Parts":
        """Δ to read a slice at a time (`parts[a:b]`), with no model-sized read: the tensor itself where it is
        held, or a reader of where it waits (p2pdiloco.training.spill)."""
        return self.get()

    def drop(self) -> None:
        self._tensor = None

    @property
    def in_memory(self) -> bool:
        return self._tensor is not None


@dataclass
class Contribution:
    kept: Kept  # pseudo-gradient Δ = Θ − θ, flat fp32: in memory, or on disk while the round runs
    tokens: int  # tokens processed since this peer's last merged contribution
    steps: int
    version: int  # global version Θ was at
    peer: str
    name: str
    digest: str  # hash of Θ
    seconds: float = 0.0  # wall time of the inner steps it covers (for goodput; never sent to peers)
    merged_by: int = 0  # members of the merge that made Θ (p2pdiloco.core.state.lineage_rank)

    @classmethod
    def of(cls, delta: torch.Tensor, **fields) -> "Contribution":
        return cls(kept=Kept(delta), **fields)

    @property
    def delta(self) -> torch.Tensor:
        """Δ itself; a read from disk where it waits there: a caller holds it only while it needs it."""
        return self.kept.get()

    @property
    def member(self) -> Member:
        return Member(peer=self.peer, name=self.name, version=self.version, digest=self.digest,
                      tokens=self.tokens, steps=self.steps, budget=0.0)


@dataclass
class RoundOutcome:
    """How one round ended for this peer. `merged` is Σ wᵢΔᵢ over `members` (None: nothing was merged).
    `state` is a global state downloaded from a peer; when set it already contains the merge (we were not on
    the group's newest state) and replaces ours; `state_before` was adopted before contributing."""

    kind: ClassVar[str] = "round"
    committed: ClassVar[bool] = False  # our contribution was merged (by us, or by the group we were stale in)

    reason: str = ""
    merged: Optional[torch.Tensor] = None
    let_go: LetGo = field(default=hold, repr=False, compare=False)  # a pass over `merged` calls it
    members: list[Member] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # each member's merge weight (sums to 1)
    merged_tokens: int = 0  # what the merge adds to Θ's token count: each member's, capped as its weight
    excluded: dict[str, str] = field(default_factory=dict)  # member peer id → why it was not merged
    bounded: dict[str, str] = field(default_factory=dict)  # member peer id → which of its claims were capped
    group_id: str = ""
    seconds: float = 0.0  # ready → outcome
    quorum_seconds: float = 0.0  # ready → K−1 others ready
    grace_seconds: float = 0.0  # how long matchmaking stayed open for more members (Eq. 3)
    waited_for_island: bool = False  # an island merged from our state without us: we waited rather than fork
    sync_seconds: float = 0.0  # group formed → all-reduce returned
    sync_ended: float = 0.0  # Unix time it returned: the round is settled later (the outer step, steps in flight)
    codec_cpu_seconds: float = 0.0  # CPU our codec thread spent in it: near sync_seconds, the round was CPU-bound
    deadline_seconds: float = 0.0  # the all-reduce deadline the group agreed on (from measured link speeds)
    allreduce_bytes_model: int = 0  # what the all-reduce layout says this peer sends (and receives)
    bytes_sent: Optional[int] = None  # measured: what our averager process wrote during the round (procio)
    bytes_received: Optional[int] = None
    state_before: Optional[StateTuple] = None
    state: Optional[StateTuple] = None
    stale: bool = False  # we were not on the group's newest state: the merge applies to theirs, not ours

    @property
    def adopted(self) -> bool:
        return self.state is not None or self.state_before is not None

    def record(self) -> dict:
        """What a round record (runtime.schema.Round) says of this outcome, by its field names: written here once,
        so the record is the outcome as it is."""
        members = self.members
        return dict(
            reason=self.reason, outcome=self.kind, members=[m.name or m.peer for m in members],
            member_tokens=[m.tokens for m in members], member_versions=[m.version for m in members],
            member_steps=[m.steps for m in members], member_norms=[m.delta_norm for m in members],
            excluded=self.excluded, bounded=self.bounded, weights=self.weights,
            tokens_merged=self.merged_tokens, group_id=self.group_id, round_seconds=self.seconds,
            quorum_seconds=self.quorum_seconds, sync_seconds=self.sync_seconds, sync_ended=self.sync_ended or None,
            codec_cpu_seconds=self.codec_cpu_seconds, deadline_seconds=self.deadline_seconds,
            grace_seconds=self.grace_seconds, bytes_sent=self.bytes_sent, bytes_received=self.bytes_received,
            allreduce_bytes_model=self.allreduce_bytes_model, adopted=self.adopted,
            waited_for_island=self.waited_for_island)


@dataclass
class Committed(RoundOutcome):
    """A verified island merged our contribution with the others'."""

    kind: ClassVar[str] = "committed"
    committed: ClassVar[bool] = True


@dataclass
class Solo(RoundOutcome):
    """Alone in the swarm with K=1: our own update is the merge. The round protocol leaves `merged` to its
    driver (`own`), which knows where Δ waits and what its wire would have carried: swarm.rounds writes it into
    the averaging buffer a chunk at a time, not into a model-sized copy. `of` makes it a copy of Δ."""

    kind: ClassVar[str] = "solo"
    committed: ClassVar[bool] = True

    @classmethod
    def of(cls, c: Contribution, **kwargs) -> "Solo":
        return cls.own(c, merged=c.delta.clone(), **kwargs)

    @classmethod
    def own(cls, c: Contribution, **kwargs) -> "Solo":
        return cls(reason="solo", members=[c.member], weights=[1.0], merged_tokens=c.tokens, **kwargs)


@dataclass
class RolledBack(RoundOutcome):
    """Nothing was merged: no island, or the round failed verification. Our Δ rides along next time."""

    kind: ClassVar[str] = "rolled_back"


@dataclass
class Adopted(RoundOutcome):
    """Nothing of ours was merged, but we took a newer global state first (we were behind, or on a fork)."""

    kind: ClassVar[str] = "adopted"


@dataclass
class Left(RoundOutcome):
    """The peer is leaving: the round was cancelled or given up."""

    kind: ClassVar[str] = "left"


def newest_member(members: list[Member]) -> Member:
    """The member whose global state the group's merge is applied to: the highest (version, digest). Members
    publish no count of who merged their states, so this is not quite the order forks reconcile by
    (p2pdiloco.core.state.lineage_rank); every member of the group picks the same one, and its merge makes a
    newer version than either state."""
    return max(members, key=lambda m: m.key)
