"""Chaos run vs failure-free run of the same length, side by side in one invocation.

SIGKILLs peers at drawn phases of a round (joining / in a round / training) about every --kill-every
seconds, freezes whole peer trees with SIGSTOP/SIGCONT, restarts the killed peers (they resume from their
checkpoints and catch up), adds newcomers, all through random live peers rather than the bootstrap node.
Reports goodput, uptime, the longest stall of any live peer, agreement (forks, split islands) and the final
validation loss of the global model. Run it inside a loopback-only namespace:

    unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/ops/chaos.py --seconds 600'

Usage: python scripts/ops/chaos.py [--peers 5] [--seconds 600] [--kill-every 30] [--kill peer|worker|mixed]
                                  [--no-baseline] [-- join flags]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from p2pdiloco.ops.chaos import Chaos, ChaosPlan

DEFAULT_JOIN = ["--model", "tiny", "--threads", "1", "-H", "20", "--eval-every", "0", "--checkpoint-every", "1"]
SHOWN = ["seconds", "slots", "kills", "kills_by_phase", "kills_by_target", "freezes", "restarts", "exits",
         "newcomers", "goodput", "goodput_of_alive_time", "utilization", "uptime", "uptime_window_seconds", "versions",
         "model_tokens", "longest_stall_seconds", "longest_without_merge_seconds", "join_seconds_median",
         "join_seconds_max", "restart_seconds_median",
         "rounds", "rounds_merged", "rounds_with_fork", "max_fork_distance", "final_fork_distance", "split_islands",
         "final_val_median", "final_val", "loss_per_kill_seconds_max", "loss_per_kill_seconds_median"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--kill-every", type=float, default=30)
    parser.add_argument("--kill", choices=["peer", "worker", "mixed"], default="peer",
                        help="peer: SIGKILL a peer's whole process tree, restarted after 2-10 s (a machine lost); "
                        "worker: its supervised process only, which its supervisor restarts at once (a crash); "
                        "mixed: either, drawn at each kill")
    parser.add_argument("--freeze-every", type=float, default=90)
    parser.add_argument("--add-every", type=float, default=150)
    parser.add_argument("--max-peers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the failure-free run")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/chaos"))
    parser.add_argument("join", nargs="*", help="`p2pdiloco join` flags for every peer (after --), after the "
                        f"defaults ({' '.join(DEFAULT_JOIN)}): a flag given again wins")
    a = parser.parse_args()
    join = DEFAULT_JOIN + a.join  # not instead of them: `-- --nice 10` alone once ran `small` at H = 100
    plan = ChaosPlan(peers=a.peers, seconds=a.seconds, kill_every=a.kill_every, kill=a.kill,
                     freeze_every=a.freeze_every, add_every=a.add_every, max_peers=a.max_peers, seed=a.seed)
    results = {}
    if not a.no_baseline:
        results["failure-free"] = Chaos(plan.failure_free, a.log_dir / "failure-free", join).run()
    results["chaos"] = Chaos(plan, a.log_dir / "chaos", join).run()
    (a.log_dir / "report.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'':<32}" + "".join(f"{name:>22}" for name in results))
    for key in SHOWN:
        print(f"{key:<32}" + "".join(f"{_fmt(r.get(key)):>22}" for r in results.values()))
    if "failure-free" in results:  # the goal's figure: chaos over failure-free, side by side
        free, chaos = results["failure-free"], results["chaos"]
        for key in ("goodput", "model_tokens"):
            print(f"{key + ', chaos / failure-free':<32}{chaos[key] / max(free[key], 1e-9):>44.4g}")
    print(f"\nfull report: {a.log_dir / 'report.json'}")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ",".join(f"{k[:5]}={v}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in value)[:21]
    return str(value)


if __name__ == "__main__":
    main()
