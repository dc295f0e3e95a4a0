"""Goodput at the paper's scale: every simulator mode under both learner-failure models, for M = 2, 4, 8, 16, over
several seeds, beside the Decoupled DiLoCo paper's figures. Writes a JSON of every run and a PNG.
    python scripts/bench/bench_goodput.py [--seeds 3] [--days 7] [--out docs/bench/goodput.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from pathlib import Path

from p2pdiloco.sim.params import MODES, SimParams
from p2pdiloco.sim.run import simulate

PAPER = {"decoupled": {2: 0.70, 4: 0.82, 8: 0.88, 16: 0.93}, "elastic": 0.58, "dp": 0.27}
FAILURES = ("elastic", "restart")


def one(args: tuple) -> dict:
    p, mode = args
    r = simulate(p, mode)
    return dict(r.as_dict(), learners=p.learners, seed=p.seed, failure_model=p.failure)


def summary(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return {}
    return dict(mean=statistics.mean(values), low=min(values), high=max(values))


def table(rows: list[dict], learners: list[int]) -> str:
    lines = ["| failure model | mode | " + " | ".join(f"M = {m}" for m in learners) + " |",
             "|---|---|" + "---|" * len(learners)]
    for failure in FAILURES:
        for mode in MODES:
            cells = []
            for m in learners:
                runs = [r for r in rows if r["failure_model"] == failure and r["mode"] == mode and r["learners"] == m]
                g = summary(runs, "goodput")
                cells.append(f"{g['mean']:.1%} ({g['low']:.1%}–{g['high']:.1%})" if g else "–")
            lines.append(f"| {failure} | {mode} | " + " | ".join(cells) + " |")
    paper = [f"{PAPER['decoupled'][m]:.0%}" if m in PAPER["decoupled"] else "–" for m in learners]
    lines.append("| paper | decoupled | " + " | ".join(paper) + " |")
    lines.append(f"| paper | elastic / dp | {PAPER['elastic']:.0%} / {PAPER['dp']:.0%} (M = 8's setting) |"
                 + " |" * (len(learners) - 1))
    return "\n".join(lines)


def details(rows: list[dict], learners: list[int]) -> str:
    lines = ["| failure model | mode | M | outer steps | rollbacks | forks | learners merged per step | "
             "share of the live merged |", "|---|---|---|---|---|---|---|---|"]
    for failure in FAILURES:
        for mode in ("sync-diloco", "decoupled", "central"):
            for m in learners:
                runs = [r for r in rows if r["failure_model"] == failure and r["mode"] == mode and r["learners"] == m]
                cells = []
                for key, fmt in (("rounds", "{:.0f}"), ("rollbacks", "{:.0f}"), ("forks", "{:.0f}"),
                                 ("merged_per_step", "{:.2f}"), ("live_share_merged", "{:.2f}")):
                    s = summary(runs, key)
                    cells.append(fmt.format(s["mean"]) if s else "–")
                lines.append(f"| {failure} | {mode} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], learners: list[int], path: Path, days: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, failure in zip(axes, FAILURES):
        for mode in MODES:
            means = [summary([r for r in rows if r["failure_model"] == failure and r["mode"] == mode
                              and r["learners"] == m], "goodput").get("mean") for m in learners]
            if None not in means:  # a failure model not run this time
                ax.plot(learners, means, marker="o", label=mode)
        ax.plot(list(PAPER["decoupled"]), list(PAPER["decoupled"].values()), "k*", markersize=11,
                label="paper: decoupled")
        ax.axhline(PAPER["elastic"], color="grey", linestyle="--", linewidth=0.8, label="paper: elastic DP")
        ax.axhline(PAPER["dp"], color="grey", linestyle=":", linewidth=0.8, label="paper: DP")
        ax.set(xscale="log", xlabel="learners M", title=f"learners fail as: {failure}", ylim=(0, 1.02))
        ax.set_xticks(learners)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"1.2M chips, chip MTBI 1 year, {days:g} simulated days, defaults otherwise (mean over seeds)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--learners", default="2,4,8,16")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--failures", default=",".join(FAILURES), help="the learners' failure models to run")
    parser.add_argument("--checkpoint-seconds", type=float, help="restart: the learners' local checkpoints")
    parser.add_argument("--out", type=Path, default=Path("runs/goodput/goodput.json"))
    a = parser.parse_args()
    learners = [int(m) for m in a.learners.split(",")]
    extra = {} if a.checkpoint_seconds is None else dict(checkpoint_seconds=a.checkpoint_seconds)
    jobs = [(SimParams(learners=m, seed=seed, days=a.days, failure=failure, **extra), mode)
            for failure in a.failures.split(",") for m in learners for seed in range(a.seeds) for mode in MODES]
    with ProcessPoolExecutor(a.workers) as pool:
        rows = list(pool.map(one, jobs))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    base = dataclasses.asdict(SimParams())
    a.out.write_text(json.dumps(dict(when=datetime.now().isoformat(timespec="seconds"), seeds=a.seeds, days=a.days,
                                     defaults=base, paper=PAPER, runs=rows), indent=1))
    plot(rows, learners, a.out.with_suffix(".png"), a.days)
    print(table(rows, learners))
    print()
    print(details(rows, learners))
    print(f"\n{a.out}, {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
