"""Tokens per second of one member as it gets more local ranks (torchrun, DDP inside): a lone member trains for
--seconds with 1, 2, ... ranks in turn (each rank --threads torch threads, so each rank has its own cores where
the machine has them), and the member's tokens per second come from its summary record. Run it inside a
loopback-only namespace:
    unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench/bench_ranks.py --ranks 1,2'
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from p2pdiloco.ops.launcher import peer_command, start_process, stop_tree
from p2pdiloco.runtime.schema import Summary, of_kind, read_records


def run(ranks: int, a, folder: Path) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    join = peer_command("join", "--model", a.model, "--name", "m", "--log-dir", str(folder), "--checkpoint-dir",
                        str(folder / "ck"), "--max-time", str(a.seconds), "--eval-every", "0", "--checkpoint-every",
                        "0", "--threads", str(a.threads), *a.join)
    if ranks > 1:
        join = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                *join[1:]]
    proc = start_process(join, folder / "m.out")
    try:
        proc.wait(a.seconds + 600)
    finally:
        stop_tree(proc)
    summary = of_kind(read_records(folder / "m.jsonl"), Summary)[-1]
    return dict(ranks=ranks, tokens_per_s=summary.tokens / summary.training_seconds, tokens=summary.tokens,
                training_seconds=summary.training_seconds, exit=proc.returncode)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seconds", type=float, default=90.0, help="each run's --max-time")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/ranks.json"))
    parser.add_argument("join", nargs="*", help="more `p2pdiloco join` flags (after --)")
    a = parser.parse_args()
    counts = [int(n) for n in a.ranks.split(",")]
    folder, rows = Path(tempfile.mkdtemp(prefix="ranks-")), []
    try:
        for _ in range(a.repeats):
            for n in counts:
                rows.append(run(n, a, folder / "run"))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rate = {n: statistics.mean(r["tokens_per_s"] for r in rows if r["ranks"] == n) for n in counts}
    result = dict(model=a.model, threads_per_rank=a.threads, seconds=a.seconds, runs=rows, tokens_per_s=rate,
                  speedup={n: rate[n] / rate[counts[0]] for n in counts})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    for n in counts:
        print(f"{a.model}, {n} rank(s) × {a.threads} thread(s): {rate[n]:.0f} tokens/s, "
              f"{rate[n] / rate[counts[0]]:.3f}× {counts[0]} rank(s)")
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
