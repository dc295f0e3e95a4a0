"""What timed checkpoints (--checkpoint-seconds) cost: one peer trains alone for --seconds with them off, written
inline (--no-checkpoint-background) and written by a second thread (the default), in turn (off, inline, background,
off, ...), and tokens per second are compared side by side (round-based saves off: --checkpoint-every 1000000 in
the "on" runs). Each write's time, and the training thread's stall for it, come from the peer's own checkpoint
records: stall / interval is the cost without the run-to-run noise. Run it inside a loopback-only namespace:
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


MODES = {"off": [], "inline": ["--no-checkpoint-background"], "background": ["--checkpoint-background"]}


def run(model: str, mode: str, every: str, seconds: float, folder: Path, extra: list[str]) -> dict:
    """`every`: a number of seconds, or "auto" (the default interval)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    every = "0" if mode == "off" else every
    timed = [] if every == "auto" else ["--checkpoint-seconds", every]
    args = peer_command("join", "--model", model, "--name", "p", "--log-dir", str(folder), "--checkpoint-dir",
                        str(folder / "ck"), "--max-time", str(seconds), "--eval-every", "0", "--checkpoint-every",
                        "0" if every == "0" else "1000000", *timed, *MODES[mode], *extra)
    proc = start_process(args, folder / "p.out")
    try:
        proc.wait(seconds + 600)
    finally:
        stop_tree(proc)
    records = read_records(folder / "p.jsonl")
    summary = of_kind(records, Summary)[-1]
    timed = [r for r in of_kind(records, Checkpoint) if r.why == "timed" and r.seconds is not None]
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    return dict(mode=mode, every=every, tokens_per_s=summary.tokens / summary.training_seconds, tokens=summary.tokens,
                training_seconds=summary.training_seconds, timed_writes=len(timed),
                write_seconds_median=median([r.seconds for r in timed]),
                stall_seconds_median=median([r.stall_seconds for r in timed if r.stall_seconds is not None]),
                stall_share=sum(r.stall_seconds or 0.0 for r in timed) / summary.training_seconds,
                exit=proc.returncode)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="large")
    parser.add_argument("--every", default="auto", help="--checkpoint-seconds of the 'on' runs (auto: the default)")
    parser.add_argument("--modes", default="off,inline,background")
    parser.add_argument("--seconds", type=float, default=180.0, help="each run's --max-time")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/checkpoint-cost.json"))
    parser.add_argument("join", nargs="*", help="more `p2pdiloco join` flags (after --)")
    a = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ckcost-"))
    modes, rows = a.modes.split(","), []
    try:
        for _ in range(a.pairs):
            for mode in modes:
                rows.append(run(a.model, mode, a.every, a.seconds, folder / "run", a.join))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in modes}
    rate = {m: statistics.mean(r["tokens_per_s"] for r in rs) for m, rs in by_mode.items()}
    share = {m: statistics.mean(r["stall_share"] for r in rs) for m, rs in by_mode.items()}
    result = dict(model=a.model, every=a.every, seconds=a.seconds, runs=rows, tokens_per_s=rate, stall_share=share,
                  **({f"{m}_over_off": rate[m] / rate["off"] for m in modes if m != "off"} if "off" in rate else {}))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    for m in modes:
        print(f"{a.model} {m:>10}: tokens/s {rate[m]:.0f}"
              + (f" ({rate[m] / rate['off']:.4f} of off)" if "off" in rate else "")
              + f", training thread stalled {100 * share[m]:.2f}% of its time")
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
