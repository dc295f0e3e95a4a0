"""4-peer swarm vs 1 peer alone, same per-peer settings, run back to back in one invocation.

Reports validation loss at equal wall-clock (each run gets the same seconds) and at equal total tokens (the
swarm's val loss at the first round where its summed tokens reach the solo run's total). Threads: every peer
uses --threads 1, so 4 swarm peers share this machine's cores (on 2 cores each swarm peer gets ~half a core).
Every peer runs on the CPU unless --device says otherwise (the comparison is a core per peer; `auto` would put
all of them on one GPU where there is one: on an H100 machine it did). Each peer evaluates Θ after every
--eval-every merged rounds; the time that takes is not training time, and the solo peer, which merges after every
H steps, evaluates more often than a swarm peer: each run's compute share of its wall time is reported.
Each run's val-loss curve (peer0's view, by version) and the swarm's merges with a member a version behind are
reported too. --join-args passes further `join` flags to every peer of both runs (e.g. "--stale-factor 1").
Usage: python scripts/bench/bench_swarm_vs_solo.py [--seconds 180] [--peers 4] [--model tiny] [--device cpu]
       [--eval-every 1] [--join-args "..."]
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path

from p2pdiloco.ops.launcher import run_local_swarm
from p2pdiloco.ops.swarmreport import forks, island_waits, stale_merges
from p2pdiloco.runtime.schema import read_records


def run(n_peers: int, seconds: float, model: str, log_dir: Path, device: str, eval_every: int,
        join_args: list[str]) -> list[list[dict]]:
    args = ["--model", model, "--threads", "1", "-H", "25", "--max-time", str(seconds), "--run-id", f"bench{n_peers}",
            "--device", device, "--eval-every", str(eval_every), *join_args]
    run_local_swarm(n_peers, log_dir, args, stagger=0.2)
    return [read_records(log_dir / f"peer{i}.jsonl") for i in range(n_peers)]


def final_val(records: list[list[dict]]) -> float:
    return min(r[-1].final_val for r in ([x for x in rec if x.kind == "summary"] for rec in records))


def compute_share(records: list[list[dict]]) -> float:
    """The peers' mean compute time over wall time while training (evaluations and waits are not compute)."""
    shares = [r.utilization for rec in records for r in rec if r.kind == "summary"]
    return round(sum(shares) / len(shares), 3)


def tokens_curve(records: list[list[dict]]) -> list[tuple[int, float]]:
    """(total tokens merged by the swarm, val loss) after each committed version, from peer0's view."""
    rounds = [r for r in records[0] if r.kind == "round" and r.applied and r.val_loss is not None]
    total, curve = 0, []
    for r in rounds:
        total += sum(r.member_tokens)
        curve.append((total, r.val_loss))
    return curve


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu", help="every peer's --device (cpu: a core per peer)")
    parser.add_argument("--eval-every", type=int, default=1, help="every peer's --eval-every")
    parser.add_argument("--join-args", default="", help="further `join` flags for every peer of both runs")
    a = parser.parse_args()
    extra = shlex.split(a.join_args)
    with tempfile.TemporaryDirectory() as tmp:
        solo = run(1, a.seconds, a.model, Path(tmp) / "solo", a.device, a.eval_every, extra)
        swarm = run(a.peers, a.seconds, a.model, Path(tmp) / "swarm", a.device, a.eval_every, extra)
    solo_curve, swarm_curve = tokens_curve(solo), tokens_curve(swarm)
    solo_tokens, solo_val = solo_curve[-1]
    at_equal_tokens = next((v for t, v in swarm_curve if t >= solo_tokens), None)
    result = dict(
        seconds=a.seconds, model=a.model, peers=a.peers, threads_per_peer=1, device=a.device, eval_every=a.eval_every,
        join_args=a.join_args,
        solo=dict(tokens=solo_tokens, val_loss=final_val(solo), versions=len(solo_curve),
                  compute_share=compute_share(solo)),
        swarm=dict(tokens=swarm_curve[-1][0], val_loss=final_val(swarm), versions=len(swarm_curve),
                   compute_share=compute_share(swarm)),
        swarm_val_at_solo_tokens=at_equal_tokens,
        solo_curve=[round(v, 4) for _, v in solo_curve], swarm_curve=[round(v, 4) for _, v in swarm_curve],
        swarm_stale_merges=stale_merges(swarm), swarm_forks=forks(swarm), swarm_island_waits=island_waits(swarm),
        val_ratio_equal_wallclock=final_val(swarm) / final_val(solo),
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
