"""How far a global state can honestly move in a few versions: the check on every state a peer downloads.

A downloaded state is checked for shape, finiteness and its donor's announced digest, which a liar satisfies
with any tensors it likes. A member that claims a newer version than it holds makes the others stale, and they
then download the merge's result from it: without this check, one peer could replace the model.

Each verified merge a peer takes part in (stale or not) tells it how far that merge moves Θ and the outer
momentum when applied to its own state (`OuterOptimizer.moves`, from its own momentum and the merged update
every member holds bit for bit). A downloaded state k versions from ours, counted through the newest key both
lineages share (k capped at `max_versions`), may be `slack`·k of the largest recent such moves away. So a
liar moves Θ at most that far in a round (six recent outer steps, at the cap): a bounded step, like a lying
contribution's, not a replacement. Beyond it, its key is refused and it is blamed. A state further away is
taken only when two or more donors serve it, or every other live peer does (the swarm moved on while we were
away; in a swarm of two, nothing tells a liar from the only other peer). A peer that saw no merge yet (a
joiner, a restart) has nothing to measure by and takes the best state, as before. Moves are learnt only from
merges, never from downloaded states: a liar's accepted state would otherwise widen the next allowance, and the
next."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from p2pdiloco.core.exact import chunks
from p2pdiloco.runtime.paging import LetGo, hold

MOVES_SEEN = 16  # the merges whose largest move sets the allowance
DISTANCE_CHUNK = 1 << 20


def distances(ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor],
              let_go: LetGo = hold) -> list[float]:
    """‖a − b‖ for each pair, a chunk at a time (one chunk-sized temporary); `let_go` is told each chunk of `ours`
    read."""
    out = []
    for a, b in zip(ours, theirs):
        total = 0.0
        for part in chunks(a.numel(), DISTANCE_CHUNK):
            total += float(torch.linalg.vector_norm(torch.sub(b[part], a[part]))) ** 2
            let_go(part)
        out.append(math.sqrt(total))
    return out


def versions_apart(ours: Sequence[tuple[int, str]], theirs: Sequence[tuple[int, str]]) -> Optional[int]:
    """Outer steps from our state to theirs through the newest key both histories hold (oldest first, each
    ending with its own key); None where they share none."""
    shared = set(map(tuple, ours)) & set(map(tuple, theirs))
    if not shared:
        return None
    ancestor = max(v for v, _ in shared)
    return (ours[-1][0] - ancestor) + (theirs[-1][0] - ancestor)


@dataclass
class Reach:
    """The moves of the merges this peer saw, and what they allow a downloaded state."""

    slack: float = 2.0  # Nesterov's momentum can lengthen each step while it builds up (tests/unit/test_reach.py)
    max_versions: int = 3
    moves: deque = field(default_factory=lambda: deque(maxlen=MOVES_SEEN))  # (Θ's, the momentum's) per merge

    def saw_merge(self, theta: float, momentum: float) -> None:
        if math.isfinite(theta) and math.isfinite(momentum):
            self.moves.append((theta, momentum))

    def allowance(self, versions: Optional[int]) -> Optional[tuple[float, float]]:
        """How far Θ and the momentum may move over `versions` (None: no shared history, taken as the cap);
        None where we have seen no merge to measure by."""
        if not self.moves:
            return None
        steps = self.slack * min(self.max_versions, self.max_versions if versions is None else versions)
        return steps * max(t for t, _ in self.moves), steps * max(m for _, m in self.moves)

    def checks(self, corroborated: bool) -> bool:
        """Whether a state is held to a distance at all (the pass over it costs a read of Θ and the momentum)."""
        return not corroborated and bool(self.moves)

    def why_not(self, moved: Sequence[float], versions: Optional[int], corroborated: bool = False) -> Optional[str]:
        """Why a state this far from ours (Θ's distance, the momentum's) is not taken, or None. `corroborated`: more
        than one peer served it, or every other live peer did (the swarm moved on while we were away)."""
        allowed = self.allowance(versions)
        if allowed is None or corroborated:
            return None
        for name, distance, limit in zip(("Θ", "the outer momentum"), moved, allowed):
            if not distance <= limit:
                apart = "no shared history" if versions is None else f"{versions} version(s) apart"
                return f"{name} would move {distance:.4g}, more than {limit:.4g} ({apart}), served by one peer alone"
        return None


@dataclass
class RefusedKeys:
    """State keys (version, digest) this peer refused, until when (seconds on the caller's clock): a record that
    announces one is not a donor, nor a reason to catch up, so a liar's claim costs one download, not one a
    round. A liar can mint new keys; `limit` bounds what we remember of them."""

    seconds: float = 600.0
    limit: int = 256
    until: dict = field(default_factory=dict)

    def refuse(self, key: tuple[int, str], now: float) -> None:
        self.active(now)
        self.until[tuple(key)] = now + self.seconds
        while len(self.until) > self.limit:
            del self.until[min(self.until, key=self.until.get)]

    def active(self, now: float) -> set:
        self.until = {k: t for k, t in self.until.items() if t > now}
        return set(self.until)
