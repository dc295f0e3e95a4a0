"""Forks in a real local swarm, with and without --wait-for-island, side by side in one invocation.

Each variant (--variants; `on+newest` adds --wait-for-newest) is a local swarm of --peers peers (short rounds, H = 25 by default, where Eq. 3's grace window is a
few seconds and a peer a few seconds late misses an island). With --together (the default) the variants run at
the same time, each swarm its own run id and bootstrap node, so both meet the same load on this machine; a loaded
machine is where peers come late. Repeated --reps times. Per variant: the versions made twice (forks), the rounds
that waited for an island merging without them and how they ended, merged rounds, the highest version and the
final validation loss (mean over peers).
Usage: python scripts/bench/bench_islands.py [--peers 4] [--seconds 120] [--model tiny] [--reps 1] [--sequential]
       [--join-args "..."] [--keep records.tar.gz]   # run inside a loopback-only namespace: unshare -n, then bring lo up
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from p2pdiloco.ops.launcher import run_local_swarm
from p2pdiloco.ops.swarmreport import forks, island_waits, stale_merges
from p2pdiloco.runtime.schema import read_records

VARIANTS = {"off": ["--no-wait-for-island"], "on": ["--wait-for-island"],
            "on+newest": ["--wait-for-island", "--wait-for-newest"]}


def one_swarm(variant: str, log_dir: Path, a) -> None:
    """Runs in its own process: the launcher owns its signal handlers, which only a main thread may."""
    args = ["--model", a.model, "--threads", "1", "-H", str(a.inner_steps), "--max-time", str(a.seconds),
            "--run-id", f"islands-{log_dir.name}".replace("+", "-"), "--device", "cpu", "--eval-every", "1",
            *VARIANTS[variant], *shlex.split(a.join_args)]
    run_local_swarm(a.peers, log_dir, args, stagger=0.2)


def summary(log_dir: Path, n_peers: int) -> dict:
    records = [read_records(log_dir / f"peer{i}.jsonl") for i in range(n_peers)]
    rounds = [r for rec in records for r in rec if r.kind == "round"]
    finals = [r.final_val for rec in records for r in rec if r.kind == "summary" and r.final_val is not None]
    made_twice = forks(records)
    return dict(forks=sum(n - 1 for n in made_twice.values()), fork_versions=sorted(made_twice),
                island_waits=island_waits(records), stale_merges=len(stale_merges(records)),
                rounds=len(rounds), rounds_merged=sum(r.applied for r in rounds),
                versions=max((r.version for r in rounds), default=0),
                final_val=round(statistics.mean(finals), 4) if finals else None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--inner-steps", "-H", type=int, default=25)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--sequential", action="store_true", help="one variant after the other, not together")
    parser.add_argument("--variants", default="off,on", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--join-args", default="", help="further `join` flags for every peer")
    parser.add_argument("--keep", type=Path, help="write every peer's records (JSONL) into this tar.gz")
    parser.add_argument("--one", choices=sorted(VARIANTS), help=argparse.SUPPRESS)  # a child: one swarm
    parser.add_argument("--log-dir", type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.one:
        return one_swarm(a.one, a.log_dir, a)
    chosen = a.variants.split(",")
    if not set(chosen) <= set(VARIANTS):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}")
    results = {v: [] for v in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            dirs = {v: Path(tmp) / f"{v}{rep}" for v in chosen}
            children = []
            for v, d in dirs.items():
                cmd = [sys.executable, __file__, *sys.argv[1:], "--one", v, "--log-dir", str(d)]
                children.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
                if a.sequential:
                    children.pop().wait()
            for child in children:
                child.wait()
            for v, d in dirs.items():
                results[v].append(summary(d, a.peers))
                print(v, rep, json.dumps(results[v][-1]), flush=True)
        if a.keep:
            with tarfile.open(a.keep, "w:gz") as tar:
                for jsonl in sorted(Path(tmp).glob("*/peer*.jsonl")):
                    tar.add(jsonl, arcname=f"{jsonl.parent.name}/{jsonl.name}")
    total = {v: dict(forks=sum(r["forks"] for r in rs), rounds_merged=sum(r["rounds_merged"] for r in rs),
                     versions=[r["versions"] for r in rs], final_val=[r["final_val"] for r in rs])
             for v, rs in results.items()}
    print(json.dumps(dict(peers=a.peers, seconds=a.seconds, model=a.model, inner_steps=a.inner_steps, reps=a.reps,
                          together=not a.sequential, join_args=a.join_args, runs=results, total=total), indent=1))


if __name__ == "__main__":
    main()
