"""What timed checkpoints (--checkpoint-seconds) cost: one peer trains alone for --seconds with them off and on,
alternately (off, on, off, on, ...), and tokens per second are compared side by side (round-based saves off in
both: --checkpoint-every 1000000 in the "on" runs); each write's time comes from the peer's own checkpoint
records. Run it inside a loopback-only namespace:
    unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench/bench_checkpoint.py --model large'
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from p2pdiloco.ops.launcher import peer_command, start_process, stop_tree
from p2pdiloco.runtime.schema import Checkpoint, Summary, of_kind, read_records


def run(model: str, every: str, seconds: float, folder: Path, extra: list[str]) -> dict:
    """`every`: "0" (off), a number of seconds, or "auto" (the default interval)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    timed = [] if every == "auto" else ["--checkpoint-seconds", every]
    args = peer_command("join", "--model", model, "--name", "p", "--log-dir", str(folder), "--checkpoint-dir",
                        str(folder / "ck"), "--max-time", str(seconds), "--eval-every", "0", "--checkpoint-every",
                        "0" if every == "0" else "1000000", *timed, *extra)
    proc = start_process(args, folder / "p.out")
    try:
        proc.wait(seconds + 600)
    finally:
        stop_tree(proc)
    records = read_records(folder / "p.jsonl")
    summary = of_kind(records, Summary)[-1]
    writes = [r.seconds for r in of_kind(records, Checkpoint) if r.why == "timed" and r.seconds is not None]
    return dict(every=every, tokens_per_s=summary.tokens / summary.training_seconds, tokens=summary.tokens,
                training_seconds=summary.training_seconds, timed_writes=len(writes),
                write_seconds_median=statistics.median(writes) if writes else None, exit=proc.returncode)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="large")
    parser.add_argument("--every", default="auto", help="--checkpoint-seconds of the 'on' runs (auto: the default)")
    parser.add_argument("--seconds", type=float, default=180.0, help="each run's --max-time")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/checkpoint-cost.json"))
    parser.add_argument("join", nargs="*", help="more `p2pdiloco join` flags (after --)")
    a = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ckcost-"))
    rows = []
    try:
        for _ in range(a.pairs):
            for every in ("0", a.every):
                rows.append(run(a.model, every, a.seconds, folder / "run", a.join))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    off = statistics.mean(r["tokens_per_s"] for r in rows if r["every"] == "0")
    on = statistics.mean(r["tokens_per_s"] for r in rows if r["every"] != "0")
    writes = [r["write_seconds_median"] for r in rows if r["write_seconds_median"] is not None]
    result = dict(model=a.model, every=a.every, seconds=a.seconds, runs=rows, tokens_per_s_off=off,
                  tokens_per_s_on=on, on_over_off=on / off,
                  write_seconds=statistics.median(writes) if writes else None)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"{a.model}: tokens/s off {off:.0f}, on (every {a.every} s) {on:.0f}: on/off {on / off:.4f}; "
          f"a write takes {result['write_seconds']} s -> {a.out}")


if __name__ == "__main__":
    main()
