"""The rules of one global-state download, with no network and no clock of their own: whom to ask, what to take,
when to try again and when to give up. A driver (p2pdiloco.swarm.rounds) fetches what `donors` names, reports
what came with `judge`, and does what `after_failure` says; times are seconds on the driver's clock.

- Donors: every live peer that serves the best state key at least `min_version` (peers in client mode cannot be
  dialled), but keys refused lately (p2pdiloco.core.reach.RefusedKeys).
- Taken: a state that validates, is not of a refused key, and is no further from ours than the versions between
  explain (`why_not_adopt`, given whether the state is corroborated: served by two donors, or by every live peer).
  A state refused so has its key refused for a while and its donors blamed.
- Retried: a donor that is older, dies mid-transfer or sends garbage, every `RETRY_SECONDS`, until the deadline.
- Given up: at the deadline; at once after a refusal when no other peer holds the version; and once no live peer
  has held the version, nor been making it, for longer than a record lives (`gone_after`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from p2pdiloco.core.reach import RefusedKeys
from p2pdiloco.core.state import validate_state
from p2pdiloco.protocol.island import PenaltyBox
from p2pdiloco.protocol.outcomes import StateTuple
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.protocol.round import state_may_come

RETRY_SECONDS = 0.5
WhyNotAdopt = Callable[[dict, list, bool], Optional[str]]  # a validated state too far from ours: why (None: take it)
StateKey = tuple[int, str]


@dataclass(frozen=True)
class Retry:
    after: float


@dataclass(frozen=True)
class GiveUp:
    reason: str


def state_donors(records: Sequence[PeerRecord], min_version: int) -> Optional[tuple[StateKey, list[str]]]:
    """The best state key at least `min_version` and every peer that can serve it: peers in client mode cannot
    (nobody can dial them), so they are never asked."""
    records = [r for r in records if r.version >= min_version and not r.client_mode]
    if not records:
        return None
    best = max(records, key=lambda r: r.rank).key
    return best, [r.peer for r in records if r.key == best]


class StateDownload:
    def __init__(self, min_version: int, n_params: int, deadline: float, refused: RefusedKeys, penalties: PenaltyBox,
                 why_not_adopt: WhyNotAdopt, gone_after: float):
        self.min_version, self.n, self.deadline = min_version, n_params, deadline
        self.refused, self.penalties, self.why_not_adopt = refused, penalties, why_not_adopt
        self.gone_after = gone_after  # no live peer holds or makes the version this long: it will not come
        self.refused_here = False  # this download refused a state: a retry would only find the same donor
        self.gone_since: Optional[float] = None
        self.refusals: list[str] = []  # what was refused and why, for the driver's log

    def live(self, records: Sequence[PeerRecord], now: float) -> list[PeerRecord]:
        """The records that still count: those not announcing a state we refused."""
        refused = self.refused.active(now)
        return [r for r in records if r.key not in refused]

    def donors(self, records: Sequence[PeerRecord], now: float) -> Optional[tuple[StateKey, list[str]]]:
        return state_donors(self.live(records, now), self.min_version)

    def may_fetch_whole(self, donors, keyed_swarm: bool) -> bool:
        """hivemind's one-donor download, where the parts failed: it has no room for a pass (a swarm with a key),
        and would pick a refused donor again. Only while a live peer holds the version: else it can only fetch an
        older state, whole, to refuse it."""
        return donors is not None and not keyed_swarm and not self.refused_here

    def judge(self, loaded: Optional[StateTuple], donors: list[str], records: Sequence[PeerRecord],
              now: float) -> Optional[str]:
        """Why `loaded` (served by `donors`; none named: hivemind's one-donor download) is not taken; None: take it."""
        if loaded is None:
            return "no peer shared its state"
        problem = validate_state(*loaded, self.n, self.min_version)
        if problem:
            return problem
        metadata, tensors = loaded
        key = (metadata["version"], metadata["digest"])
        if key in self.refused.active(now):
            return f"state v{key[0]} was refused before"
        others = {r.peer for r in self.live(records, now)}
        corroborated = len(donors) >= 2 or bool(donors) and others <= set(donors)
        why = self.why_not_adopt(metadata, tensors, corroborated)
        if why is None:
            return None
        self.refused.refuse(key, now)
        self.penalties.blame(donors, now)
        self.refused_here = True
        self.refusals.append(f"refused state v{key[0]} from {[d[-6:] for d in donors] or 'one donor'}: {why}")
        return f"refused: {why}"

    def after_failure(self, problem: str, records: Sequence[PeerRecord], now: float, leaving: bool) -> Retry | GiveUp:
        others = self.live(records, now)  # read again: a key refused just now no longer counts
        if self.refused_here and state_donors(others, self.min_version) is None:
            return GiveUp(f"{problem}; no other peer holds v{self.min_version} or later")
        if now >= self.deadline or leaving:
            return GiveUp(problem)
        # its holders gone for longer than a record lives: seen on the testbed, two peers behind spent the
        # whole deadline (minutes for a large model) asking each other for a state only a departed peer had
        if state_may_come(others, self.min_version):
            self.gone_since = None
        elif self.gone_since is None:
            self.gone_since = now
        elif now - self.gone_since > self.gone_after:
            return GiveUp(f"{problem}; no live peer holds v{self.min_version} or later, nor is making it")
        return Retry(RETRY_SECONDS)
