"""The reference a peer-to-peer swarm is measured against: the same learners, under the same failures, with an
ideal central synchronizer. Every H steps a learner sends its codes up and gets the merged update back
(`sizes.central_seconds`): no matchmaking, no islands, no forks, no rollbacks. What decoupled loses against it is
the price of having no coordinator."""

from __future__ import annotations

from p2pdiloco.sim.decoupled import DecoupledSim, Learner
from p2pdiloco.sim.baselines import SimResult
from p2pdiloco.sim.failures import Draws
from p2pdiloco.sim.params import SimParams
from p2pdiloco.sim.sizes import central_seconds


class CentralSim(DecoupledSim):
    mode = "central"

    def _contribute(self, t: float, learner: Learner) -> None:
        self._take_work(t, learner)
        learner.round = "central"  # in flight: the next contribution waits for it, as a peer's does
        self._push(t + central_seconds(self.p), "synced", learner, learner.life)

    def _on_synced(self, t: float, learner: Learner, life: int) -> None:
        if life != learner.life:
            return  # it died before the synchronizer had it: its checkpoint kept what it could
        self._count_useful(learner, learner.in_round)
        self.commits += 1
        self.merged.append((1, self._up()))
        self.outcomes["committed"] = self.outcomes.get("committed", 0) + 1
        learner.version, learner.digest = self.commits, f"v{self.commits}"
        learner.in_round, learner.round = [], None
        if learner.due:
            self._contribute(t, learner)

    def _seen(self) -> list[tuple]:
        return []  # nobody reads records


def simulate_central(p: SimParams, d: Draws) -> SimResult:
    return CentralSim(p, d).run()
