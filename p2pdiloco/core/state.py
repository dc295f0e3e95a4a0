"""The global state Θ every peer keeps a copy of, its version, and the order that reconciles copies.

There is no central holder of Θ. Members of one round apply the same merged update and stay bit-identical;
peers that merged in different islands may hold different states at the same version (a fork). Every peer
ranks states by the same total order, `lineage_rank` = (version, members of the merge that made it, digest), and
moves to the highest one it sees. Because everyone uses the same order, two forks reconcile as soon as either side
sees the other; at one version the state of the larger island wins, so the fewer members' work is what is redone
(by digest alone, a pair that merged apart from four won half the time). `lineage_key` = (version, digest) names a
state.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Iterator, Optional, Sequence

import torch

from p2pdiloco.core.exact import all_finite, digest
from p2pdiloco.core.outer import OuterOptimizer
from p2pdiloco.core.reach import Reach, distances, versions_apart
from p2pdiloco.runtime.paging import LetGo, hold


MAX_MERGED_BY = 255  # members of one merge, as far as the order counts them (islands are far smaller)


def lineage_key(version: int, state_digest: str) -> tuple[int, str]:
    """Which state: its version and digest."""
    return (int(version), str(state_digest))


def lineage_rank(version: int, merged_by: int, state_digest: str) -> tuple[int, int, str]:
    """The order forks reconcile by: the newer version, then the state more members merged, then the digest.
    `merged_by`: the members of the merge that made the state (0 for a state no merge made)."""
    return (int(version), min(max(int(merged_by), 0), MAX_MERGED_BY), str(state_digest))


def merged_by(metadata: dict) -> int:
    """The members of the merge that made a state, from its metadata (0 where it names none)."""
    members = metadata.get("last_members")
    return len(members) if isinstance(members, (list, tuple)) else 0


def sharing_priority(version: int, merged_by: int, state_digest: str) -> float:
    """hivemind picks the donor with the highest priority (random among ties): encode `lineage_rank` in a
    float, the members and the digest below one version step (exact up to 2^20 versions), so a joiner downloads
    the state everyone converges to."""
    below = (min(max(merged_by, 0), MAX_MERGED_BY) << 24) + int(state_digest[:6], 16)
    return float(version) + below / float(1 << 33)


HISTORY = 32  # (version, digest) of the latest states of a lineage, carried with the state
# the members of the latest merges, carried with the state too: a peer that died with its contribution in flight
# reads in the state it downloads on restart whether an island merged it (`merged_in`); a restart takes a version
# or two, so a few merges suffice, and each member goes as a short tag (a state's metadata stays small)
MERGES, TAG_HEX = 8, 10
MAX_TAGS = 4096  # members one merge may name in a state we read (a bound on what a donor makes us hold)
SETTLED_AFTER = 2  # merges past a contribution before a state that does not name it says it was not merged


def member_tag(peer: str) -> str:
    return hashlib.sha256(peer.encode()).hexdigest()[:TAG_HEX]


class StateChanged(RuntimeError):
    """Θ changed since a reader took note of it (`GlobalState.unchanged`)."""


class GlobalState:
    """Θ, the outer momentum and the version; `snapshot` is thread-safe (state sharing runs in a thread).

    `history` lists the keys of the states this one descends from (itself included), so a peer that adopts
    another peer's state can tell whether its own latest merge is part of it or was lost in a fork."""

    def __init__(self, params: torch.Tensor, lr: float, momentum: float,
                 storage: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 let_go: LetGo = hold):
        """Θ starts as a copy of `params`. `storage`: the two vectors to keep Θ and the momentum in (the second
        zeroed; `training.parked` maps them from a file); new memory if None. `params` may be the first.
        `let_go(part)`: a pass over Θ is done with those elements (a parked state lets their pages go)."""
        self.let_go = let_go
        if storage is None:
            storage = (torch.empty_like(params), torch.zeros_like(params))
        theta, momentum_buffer = storage
        if theta.data_ptr() != params.data_ptr():
            theta.copy_(params)
        self.outer = OuterOptimizer(theta, lr, momentum, momentum_buffer)
        self.version, self.last_members = 0, []
        self.tokens = 0  # merged into Θ over its whole lineage: the swarm's progress (the lr schedule's clock)
        self.lock, self._digest = threading.RLock(), None
        self.generation = 0  # counts every change of Θ: a reader that noted it can tell it still reads the same
        self.history: list[tuple[int, str]] = [self.key]
        self.merges: list[tuple[int, list[str]]] = []  # (version made, its members' tags) of the latest merges
        self.reach = Reach()  # how far a downloaded state may be from ours (p2pdiloco.core.reach)

    @property
    def params(self) -> torch.Tensor:
        return self.outer.params

    @property
    def digest(self) -> str:
        """Hash of Θ and the outer momentum: equal digests mean the next outer step is equal too."""
        with self.lock:
            if self._digest is None:
                self._digest = digest(*self.outer.state_tensors(), let_go=self.let_go)
            return self._digest

    @property
    def key(self) -> tuple[int, str]:
        return lineage_key(self.version, self.digest)

    @property
    def rank(self) -> tuple[int, int, str]:
        return lineage_rank(self.version, len(self.last_members), self.digest)

    def apply(self, merged: torch.Tensor, members: list[str],
              let_go: LetGo = hold, tokens: int = 0, scale: float = 1.0) -> None:
        """Θ ← outer step of Θ by `merged` (times `scale`), a chunk at a time; `let_go` is told each chunk of
        `merged` once read (as Θ's own pages are let go). `tokens`: what the members trained for it."""
        def let_go_both(part: slice) -> None:
            self.let_go(part)
            let_go(part)

        with self.lock:
            self.generation += 1
            self.outer.step(merged, let_go=let_go_both, scale=scale)
            self.version += 1
            self.tokens += max(0, int(tokens))
            self.last_members = members
            self._digest = None
            self.history = (self.history + [self.key])[-HISTORY:]
            self.merges = (self.merges + [(self.version, [member_tag(m) for m in members])])[-MERGES:]

    def snapshot(self, shared: bool = False) -> tuple[dict, list[torch.Tensor]]:
        """A consistent copy of the state. `shared`: the copy is made in shared memory, so handing it to another
        process (the averager serving it to joiners) moves a handle, not a second copy of 8 bytes per
        parameter."""
        with self.lock:
            metadata = dict(version=self.version, digest=self.digest, last_members=list(self.last_members),
                            history=[list(k) for k in self.history], tokens=self.tokens,
                            merges=[[v, list(tags)] for v, tags in self.merges])
            if not shared:
                return metadata, [t.clone() for t in self.outer.state_tensors()]
            return metadata, [torch.empty_like(t).share_memory_().copy_(t) for t in self.outer.state_tensors()]

    def island_sizes(self) -> list[int]:
        """Members of each of the latest merges of this state's lineage (outer.solo_scale)."""
        return [len(tags) for _, tags in self.merges]

    def saw_merge(self, merged: torch.Tensor, let_go: LetGo = hold, scale: float = 1.0) -> None:
        """A verified merge, applied to our state or not (we were stale): learn how far it moves ours."""
        def let_go_both(part: slice) -> None:
            self.let_go(part)
            let_go(part)

        with self.lock:
            self.reach.saw_merge(*self.outer.moves(merged, let_go=let_go_both, scale=scale))

    def why_not_adopt(self, metadata: dict, tensors: Sequence[torch.Tensor], corroborated: bool) -> Optional[str]:
        """Why a validated state is too far from ours to take (p2pdiloco.core.reach), or None; `corroborated`: served
        by more than one peer, or by every other live one."""
        if not self.reach.checks(corroborated):
            return None
        theirs = parse_history(metadata.get("history"))
        key = lineage_key(metadata["version"], metadata["digest"])
        theirs = theirs if theirs[-1:] == [key] else theirs + [key]
        with self.lock:
            apart = versions_apart(self.history, theirs)
            moved = distances(self.outer.state_tensors(), tensors, let_go=self.let_go)
        return self.reach.why_not(moved, apart, corroborated)

    @contextlib.contextmanager
    def unchanged(self, generation: int) -> Iterator[None]:
        """Hold Θ as it was at `generation` (a background checkpoint writing it); raises StateChanged if it
        changed in between."""
        with self.lock:
            if self.generation != generation:
                raise StateChanged(f"Θ changed (generation {generation} → {self.generation})")
            yield

    def load(self, metadata: dict, tensors: list[torch.Tensor]) -> None:
        with self.lock:
            self.generation += 1
            self.outer.load_state_tensors(*tensors)
            self.version = metadata["version"]
            self.tokens = parse_tokens(metadata.get("tokens"))
            self.last_members = list(metadata.get("last_members", []))
            self._digest = None
            history = parse_history(metadata.get("history"))
            self.history = (history if history[-1:] == [self.key] else history + [self.key])[-HISTORY:]
            self.merges = parse_merges(metadata.get("merges"))


def parse_merges(raw) -> list[tuple[int, list[str]]]:
    """A remote peer's latest merges, defensively: anything malformed counts as none known."""
    if not isinstance(raw, (list, tuple)) or len(raw) > MERGES:
        return []
    merges = []
    for item in raw:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], int)
                and isinstance(item[1], (list, tuple)) and len(item[1]) <= MAX_TAGS
                and all(isinstance(t, str) and len(t) == TAG_HEX for t in item[1])):
            return []
        merges.append((item[0], list(item[1])))
    return merges


def merged_in(metadata: dict, peer: str, version: int) -> Optional[bool]:
    """Whether the state of `metadata` holds the contribution `peer` made from `version`: True where a merge after
    `version` names it; False where the state names every merge since, none names it, and it is at least
    SETTLED_AFTER merges past (an island that merged it may still be settling a fork at the next version); None
    where it cannot tell (too few merges named: an older peer's state, or one too far ahead). Only the state's
    lineage counts: a merge in a fork it does not descend from is not in it (should that fork win later, our
    contribution counts twice: docs/architecture.md). A donor may lie here, as in what it serves: the worst it
    makes us do is send one contribution of ours twice, or give our progress up (as we did before we could tell)."""
    target = metadata.get("version")
    if not (isinstance(target, int) and isinstance(peer, str)) or target <= version:
        return None
    merges = dict(parse_merges(metadata.get("merges")))
    tag = member_tag(peer)
    if any(tag in tags for v, tags in merges.items() if v > version):
        return True
    settled = target >= version + SETTLED_AFTER
    return False if settled and all(v in merges for v in range(version + 1, target + 1)) else None


def parse_tokens(raw) -> int:
    """A remote peer's token count, defensively: anything but a non-negative integer counts as 0 (the count only
    drives the learning-rate schedule; Θ itself is checked by its digest)."""
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 1 << 62 else 0


def parse_history(raw) -> list[tuple[int, str]]:
    """A remote peer's history list, defensively: anything malformed counts as no history."""
    if not isinstance(raw, (list, tuple)) or len(raw) > HISTORY:
        return []
    keys = []
    for item in raw:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], int)
                and isinstance(item[1], str)):
            return []
        keys.append((item[0], item[1]))
    return keys


def contains(metadata: dict, key: Sequence) -> bool:
    """Whether a state (by its metadata) is `key` or descends from it, as far as its history reaches.
    Beyond that reach we cannot tell, and assume it does (never count work twice)."""
    history = parse_history(metadata.get("history")) + [(metadata.get("version"), metadata.get("digest"))]
    if tuple(key) in history:
        return True
    oldest = min((v for v, _ in history if isinstance(v, int)), default=0)
    return key[0] < oldest


def validate_state(metadata, tensors, n_params: int, min_version: int) -> Optional[str]:
    """Why a state downloaded from a remote peer is unacceptable, or None. Never trust the network."""
    if not isinstance(metadata, dict) or not isinstance(metadata.get("version"), int):
        return "metadata is not a dict with an integer version"
    if metadata["version"] < min_version:
        return f"donor is at version {metadata['version']}, older than ours ({min_version})"
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        return "expected parameters and momentum"
    if any(not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (n_params,)
           for t in tensors):
        return "tensors do not match this model"
    if not all_finite(*tensors):
        return "tensors contain NaN or infinity"
    if digest(*tensors) != metadata.get("digest"):
        return "state does not match the donor's announced digest"
    return None
