"""Synchronous vs decoupled rounds, 4 peers of which one is 3× slower, run back to back in one invocation.

(a) sync: every round waits for every live peer at a barrier, and training stops while it runs;
(b) decoupled: no barrier, rounds run in the background while inner steps go on;
(c) rda: decoupled, merging with radial-directional averaging (norms and directions averaged apart);
(d) eager: decoupled, training on from an estimate of the next global model while a round is in flight.
Same wall-clock budget, same model and settings, every peer `--threads 1`. Reports each fast peer's compute
utilization (time in inner steps / wall time while training; leaving at --max-time is excluded in every
mode), tokens merged per round, consensus distance over time and
validation loss of the global model at the end (equal wall-clock).
Usage: python scripts/bench/bench_decoupled.py [--seconds 150] [--modes sync,decoupled,rda,eager] [-H 20] [-- join flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from p2pdiloco.ops.launcher import run_local_swarm
from p2pdiloco.runtime.schema import read_records

N_PEERS = 4
SLOW = N_PEERS - 1  # the last peer is the slow one


MODES = {"sync": ["--mode", "sync"], "decoupled": ["--mode", "decoupled"],
         "rda": ["--mode", "decoupled", "--rda"],  # rda: decoupled rounds with radial-directional averaging
         "eager": ["--mode", "decoupled", "--application", "eager"]}  # in-flight steps from an estimate of Θ'


def run(mode: str, a, log_dir: Path) -> list[list[dict]]:
    args = ["--model", a.model, "--threads", "1", "-H", str(a.inner_steps), "--max-time", str(a.seconds),
            "--eval-every", "0", *MODES[mode], "--run-id", f"bench-{mode}", "--sync-wait", "600", *a.extra]
    run_local_swarm(N_PEERS, log_dir, args, stagger=0.2, per_peer_args={SLOW: ["--throttle", str(a.slow_factor)]})
    return [read_records(log_dir / f"peer{i}.jsonl") for i in range(N_PEERS)]


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.kind == kind]


def report(records: list[list[dict]]) -> dict:
    summaries = [of_kind(r, "summary")[-1] for r in records]
    rounds = of_kind(records[0], "round")
    merged = [r for r in rounds if r.applied]
    all_rounds = [r for peer in records for r in of_kind(peer, "round")]
    distance = [(round(r.wall), round(r.consensus_distance, 4)) for r in rounds]
    return dict(
        fast_peer_utilization=[round(s.utilization, 3) for s in summaries[:SLOW]],
        slow_peer_utilization=round(summaries[SLOW].utilization, 3),
        versions=max(s.version for s in summaries),
        tokens_trained=sum(s.tokens for s in summaries),
        tokens_merged_per_round=round(statistics.mean(r.tokens_merged for r in merged)) if merged else 0,
        mean_island=round(statistics.mean(len(r.members) for r in merged), 2) if merged else 0,
        slow_peer_rounds_merged=sum(1 for r in of_kind(records[SLOW], "round") if r.applied),
        rounds_not_merged=sum(1 for r in all_rounds if not r.applied),
        consensus_distance_over_time=distance,
        consensus_distance_max=max((d for _, d in distance), default=0.0),
        # disagreement proper: live peers at the same version with different states (forks), and how far
        # behind the most stale live peer was (the slow peer contributes from older versions, then catches up)
        fork_distance_max=max((r.fork_distance for r in all_rounds), default=0.0),
        rounds_with_fork=sum(r.fork_distance > 0 for r in all_rounds),
        version_spread_max=max((r.version_spread for r in all_rounds), default=0),
        final_digests=len({s.digest for s in summaries}),
        val_loss=[round(s.final_val, 4) for s in summaries],
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=150)
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("-H", "--inner-steps", type=int, default=20)
    parser.add_argument("--modes", default="sync,decoupled,rda", help=f"some of {','.join(MODES)}")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/bench-decoupled"))
    parser.add_argument("extra", nargs="*", help="more `p2pdiloco join` flags for every peer (after --)")
    a = parser.parse_args()
    results = {}
    for mode in a.modes.split(","):
        results[mode] = report(run(mode, a, a.log_dir / mode))
    if "sync" in results:
        sync = results["sync"]
        results["ratios_to_sync"] = {mode: dict(
            fast_utilization=round(statistics.mean(r["fast_peer_utilization"])
                                   / statistics.mean(sync["fast_peer_utilization"]), 2),
            val_loss=round(statistics.mean(r["val_loss"]) / statistics.mean(sync["val_loss"]), 3),
            tokens_trained=round(r["tokens_trained"] / sync["tokens_trained"], 2),
        ) for mode, r in results.items() if mode != "sync"}
    results["settings"] = dict(seconds=a.seconds, peers=N_PEERS, slow_factor=a.slow_factor, model=a.model,
                               inner_steps=a.inner_steps, threads_per_peer=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
