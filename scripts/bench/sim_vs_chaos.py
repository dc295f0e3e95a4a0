"""The simulator against a recorded chaos run: feed `p2pdiloco simulate`'s decoupled mode the run's setting (peers,
kill rate, restart delay) and the times measured in it (median inner step, median join, median all-reduce), and
print the simulated goodput beside the measured one. Also: the same chaos if each peer had a machine of its own
(restart in RESTART s, the step time of one peer alone on a core, measured by --solo-step or given). The peers'
local checkpoints are fed as measured too: the median gap between two checkpoints of one life (the chaos tool's
peers write one at every merge, `--checkpoint-every 1`, and on the timer in between), scaled by the step time on a
machine of one's own.
    python scripts/bench/sim_vs_chaos.py runs/chaos300/chaos [--solo-step 0.12]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from p2pdiloco.config import CHECKPOINT_FLOOR
from p2pdiloco.ops.chaos import ChaosPlan
from p2pdiloco.runtime.schema import Checkpoint, Round, Start, Window, of_kind, read_records
from p2pdiloco.sim.params import YEAR, SimParams
from p2pdiloco.sim.run import simulate

FAILURE_FREE = 1e9  # years between failures: none in a run


def checkpoint_gaps(records: list) -> list[float]:
    """Seconds between one peer's consecutive checkpoints within one life (a start begins a new one)."""
    gaps, last = [], None
    for r in records:
        if isinstance(r, Start):
            last = None
        elif isinstance(r, Checkpoint):
            if last is not None:
                gaps.append(r.time - last)
            last = r.time
    return gaps


def measured(run_dir: Path) -> dict:
    files = [read_records(path) for path in sorted(run_dir.glob("*.jsonl")) if path.name != "chaos-events.jsonl"]
    records = [r for peer in files for r in peer]
    steps = [r.step_seconds for r in of_kind(records, Window)]
    syncs = [r.sync_seconds for r in of_kind(records, Round) if r.sync_seconds]
    report = json.loads((run_dir.parent / "report.json").read_text())["chaos"]
    gaps = [g for peer in files for g in checkpoint_gaps(peer)]
    return dict(step_seconds=statistics.median(steps), sync_seconds=statistics.median(syncs) if syncs else 0.0,
                checkpoint_seconds=statistics.median(gaps) if gaps else CHECKPOINT_FLOOR,
                join_seconds=report["join_seconds_median"], seconds=report["seconds"], goodput=report["goodput"],
                goodput_of_alive_time=report["goodput_of_alive_time"], utilization=report["utilization"],
                kills=report["kills"], peer_kills=report.get("kills_by_target", {}).get("peer", report["kills"]))


def restart_delay(m: dict, plan: ChaosPlan) -> float:
    """The chaos tool's mean wait before it restarts a killed peer; a killed worker's supervisor waits for nothing."""
    return sum(plan.restart_after) / 2 * m["peer_kills"] / max(1, m["kills"])


def chaos_params(m: dict, plan: ChaosPlan, h: int, restart: float) -> SimParams:
    """Peers of one machine: the `restart` failure model, with the run's measured times standing in for the
    computed ones (the join, which includes the state download, is inside the repair; a local checkpoint as
    often as the run's peers wrote one)."""
    per_peer_mtbi = plan.kill_every * plan.peers  # kills land on one of the live peers, uniformly
    return SimParams(chips=plan.peers, learners=plan.peers, mtbi_years=per_peer_mtbi / YEAR, failure="restart",
                     repair_seconds=restart_delay(m, plan) + restart, step_seconds=m["step_seconds"],
                     inner_steps=h, sync_seconds=m["sync_seconds"], model_params=1, days=m["seconds"] / 86400,
                     checkpoint_seconds=m["checkpoint_seconds"], seed=0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path, help="the chaos run's log folder (…/chaos)")
    parser.add_argument("-H", type=int, default=20, help="the peers' H (scripts/ops/chaos.py default: 20)")
    parser.add_argument("--solo-step", type=float, help="seconds per step of one peer alone on a core")
    parser.add_argument("--restart", type=float, default=2.0, help="own machine: seconds from restart to training")
    parser.add_argument("--seeds", type=int, default=20, help="simulated runs averaged (a chaos run is short)")
    a = parser.parse_args()
    m, plan = measured(a.run_dir), ChaosPlan()
    here = chaos_params(m, plan, a.H, restart=m["join_seconds"])
    solo = a.solo_step or here.step_seconds
    own = replace(here, repair_seconds=restart_delay(m, plan) + a.restart, step_seconds=solo,
                  checkpoint_seconds=here.checkpoint_seconds * solo / here.step_seconds)  # a merge every H steps
    own_no_delay = replace(own, repair_seconds=a.restart)
    print(f"measured: {json.dumps(m)}")
    for label, p in (("this machine (as measured)", here), ("own machine, the run's restart delay", own),
                     ("own machine, restarted at once", own_no_delay)):
        goodputs = [simulate(replace(p, seed=s), "decoupled").goodput for s in range(a.seeds)]
        calm = statistics.mean(simulate(replace(p, seed=s, mtbi_years=FAILURE_FREE), "decoupled").goodput
                               for s in range(3))
        print(f"{label:<34} simulated goodput {statistics.mean(goodputs):.3f} "
              f"(seeds {min(goodputs):.3f}..{max(goodputs):.3f}; {statistics.mean(goodputs) / calm:.3f} of its "
              f"failure-free {calm:.3f}), repair {p.repair_seconds:.1f} s, step {p.step_seconds:.3f} s, "
              f"sync {p.sync_seconds:.2f} s, checkpoint every {p.checkpoint_seconds:.1f} s, "
              f"per-peer MTBI {p.mtbi_seconds:.0f} s")


if __name__ == "__main__":
    main()
