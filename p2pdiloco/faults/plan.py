"""Declarative fault plans for tests and chaos runs. A peer gets one only through `join --fault-plan` (hidden; the
launcher's environment sets it as P2PDILOCO_FAULT_PLAN); the wiring then builds the faulty subclasses of this
package in place of the production classes (`p2pdiloco.faults.seams_for`), so no production class reads a plan.

Format: comma-separated `action@version`, optionally `action@version:PEER_ID:PEER_ID...` to aim the fault at
the requests of those peers only:
- `die_in_allreduce@2`: SIGKILL this whole peer (main process and averager) shortly after the first all-reduce
  it joins with a contribution from global version 2 or later has started sending (or later: a peer that starts
  behind the others may first contribute from an older version, and would then never meet version 2);
- `die_while_sharing@3`: SIGKILL this peer while a request for a part of its state at version ≥ 3 is in
  flight; aimed at peers, it serves their first such part, then dies on their second (a donor dies
  mid-transfer, after the joiner got some parts from it);
- `slow_sharing@0`: serve each part of our state 0.2 s late (a slow donor: the others get most requests);
- `partition_until@3`: until this peer holds version 3, it looks for islands under a separate group key, so
  it can only meet peers with the same fault (two islands that form apart, on one DHT);
- `hostile_scaled@0`, `hostile_random@0`, `hostile_nan@0`: from version 0 on, this peer lies in every round: it
  sends 100× its Δ (scaled), noise (random) or NaN instead of it, and claims 1000× the tokens it trained (not
  with NaN); its block maxima are those of its honest Δ;
- `hostile_claimed@0`: the scaled liar whose claims are true of its lie: 100× its Δ and 1000× its tokens, its
  block maxima and norms measured on what it sends (no check of claims against codes can catch it; only the
  merge's bounds limit it);
- `hostile_flipped@0`, `hostile_noise@0`, `hostile_replay@0`, `hostile_tiny@0`: more liars whose claims are true
  of their lie, each with 1000× its tokens (p2pdiloco.faults.lies): −Δ; noise of Δ's norm; its first lying
  round's Δ replayed; Δ × 10⁻³ (to take weight for free);
- `hostile_ahead@1`: once this peer holds version 1, after every round it replaces its global state with one of
  its own (its Θ plus noise of Θ's spread), 5 versions ahead of the one it held, and publishes and serves
  it as its state: a member that claims a newer version than it holds (p2pdiloco.core.reach);
- `hostile_reducer@0`: from its first round, the part this peer reduces is served bent within its senders'
  claims (the others' codes flipped), with an account that hides the difference in its own share
  (p2pdiloco.faults.reducer); the version is not read.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIONS = ("die_in_allreduce", "die_while_sharing", "partition_until", "slow_sharing", "hostile_scaled",
           "hostile_random", "hostile_nan", "hostile_ahead", "hostile_claimed", "hostile_flipped", "hostile_noise",
           "hostile_replay", "hostile_tiny", "hostile_reducer")


class FaultPlanError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    action: str
    version: int
    targets: frozenset[str] = frozenset()  # peer ids it is aimed at; empty: any peer


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        faults = []
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            action, _, rest = item.partition("@")
            version, *targets = rest.split(":")
            if action not in ACTIONS or not version.isdigit():
                raise FaultPlanError(f"bad fault {item!r}: expected ACTION@VERSION[:PEER...], ACTION one of "
                                     f"{', '.join(ACTIONS)}")
            faults.append(Fault(action, int(version), frozenset(t for t in targets if t)))
        return cls(tuple(faults))

    def due(self, action: str, version: int) -> bool:
        """`action` is planned at `version` or before."""
        return any(f.action == action and f.version <= version for f in self.faults)

    def version_of(self, action: str) -> int | None:
        """The version given for `action` in the plan, or None."""
        return next((f.version for f in self.faults if f.action == action), None)

    def targets_of(self, action: str) -> frozenset[str]:
        return next((f.targets for f in self.faults if f.action == action), frozenset())

    def __bool__(self) -> bool:
        return bool(self.faults)


NO_FAULTS = FaultPlan()
