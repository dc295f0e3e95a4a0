"""The simulator's outputs: a table for people, JSON for scripts, and a PNG of goodput against M and MTBI."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from p2pdiloco.sim.run import sweep
from p2pdiloco.sim.baselines import SimResult
from p2pdiloco.sim.params import SimParams


def table(rows: Sequence[tuple[str, SimResult]]) -> str:
    lines = [f"{'':>12} {'mode':<12} {'goodput':>8} {'uptime':>8} {'failures':>9} {'outer steps':>12} "
             f"{'rollbacks':>9} {'forks':>6} {'merged':>7}"]
    for label, r in rows:
        d = r.details
        merged = f"{d['merged_per_step']:.1f}" if "merged_per_step" in d else "-"
        lines.append(f"{label:>12} {r.mode:<12} {r.goodput:>8.1%} {r.uptime:>8.1%} {r.failures:>9} {r.rounds:>12} "
                     f"{d.get('rollbacks', '-'):>9} {d.get('forks', '-'):>6} {merged:>7}")
    return "\n".join(lines)


def plot(p: SimParams, modes: Sequence[str], path: Path, learners=(1, 2, 4, 8, 16),
         mtbi_years=(0.25, 0.5, 1.0, 2.0, 4.0)) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_m = sweep(p, modes, learners=list(learners))
    by_mtbi = sweep(p, modes, mtbi_years=list(mtbi_years))
    for mode in modes:
        left.plot(learners, [r.goodput for r in by_m if r.mode == mode], marker="o", label=mode)
        right.plot(mtbi_years, [r.goodput for r in by_mtbi if r.mode == mode], marker="o", label=mode)
    left.set(xscale="log", xlabel="learners M", ylabel="goodput", ylim=(0, 1.02),
             title=f"{p.chips:,} chips, chip MTBI {p.mtbi_years:g} y")
    right.set(xscale="log", xlabel="chip MTBI (years)", ylabel="goodput", ylim=(0, 1.02),
              title=f"{p.chips:,} chips, M = {p.learners}")
    for ax in (left, right):
        ax.set_xticks(list(learners) if ax is left else list(mtbi_years))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle(f"goodput over {p.days:g} simulated days: learners {p.learner_failure} on failure (H={p.inner_steps}, "
                 f"step {p.step_seconds:g} s, repair {p.repair_seconds:g} s, rescale {p.rescale_seconds:g} s, "
                 f"{p.model_params / 1e9:g}B parameters, {p.compression}, {p.bandwidth_gbit:g} Gbit/s)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def params_dict(p: SimParams) -> dict:
    return dataclasses.asdict(p)
