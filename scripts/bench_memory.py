"""Peak host memory per parameter of one peer, per model size, side by side with the goals (issue 13).

Each size runs a 2-peer local swarm (so rounds really average: the wire buffers and the all-reduce are in the
peak) for a few short rounds; the first peer's whole process tree (the training process, its averager process,
the p2p daemon) is sampled every 50 ms. The figure is PSS (proportional set size): a page shared between the
host and its averager (hivemind shares the averaged tensors) counts once, not once per process, and the pages
of torch's libraries are split among the processes that map them. Device memory, on a GPU peer, comes from the
peer's own metrics (torch.cuda.max_memory_allocated).

Usage: python scripts/bench_memory.py [--models tiny,base,medium,large] [--optimizers adamw,adamw8bit]
       [--batch-size 4] [--device cpu] [--peers 2] [--compression none|int8|int4|int2]
       [--step-in-backward off|on|both]   (both: each size with and without, alternately, with --grad-clip 0)
Needs no root; run it inside `unshare -n` (loopback only) like the tests, or not: peers listen on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from p2pdiloco.config import model_config
from p2pdiloco.ops.launcher import join_command, peer_command, start_process, stop_tree, wait_for_file
from p2pdiloco.runtime.lifeline import descendants
from p2pdiloco.runtime.schema import Summary, of_kind, read_records

GOALS = {"cpu": {"adamw": 32.0, "adamw8bit": 20.0}, "cuda": {"adamw": 12.0, "adamw8bit": 12.0}}


def pss_bytes(pid: int) -> int:
    """PSS of one process, 0 if it is gone (smaps_rollup: one read, not a walk over every mapping)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler(threading.Thread):
    """The peak of the summed PSS of a process and all its descendants, sampled until stopped."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak, self.stopped = pid, interval, 0, threading.Event()
        self.peak_by_process: dict = {}
        self.timeline: list = []  # (wall-clock time, {process: PSS}): where the peak came from

    def run(self) -> None:
        while not self.stopped.is_set():
            pids = [self.pid, *descendants(self.pid)]
            sizes = {pid: pss_bytes(pid) for pid in pids}
            self.timeline.append((round(time.time(), 3), {_name(p): s for p, s in sizes.items() if s}))
            total = sum(sizes.values())
            if total > self.peak:
                self.peak, self.peak_by_process = total, {_name(p): s for p, s in sizes.items() if s}
            time.sleep(self.interval)


def _name(pid: int) -> str:
    try:
        return f"{pid}:{Path(f'/proc/{pid}/comm').read_text().strip()}"
    except OSError:
        return str(pid)


def measure(model: str, optimizer: str, args, log_dir: Path, in_backward: bool = False) -> dict:
    fused = ["--grad-clip", "0", "--step-in-backward"] if in_backward else \
        ["--grad-clip", "0"] if args.step_in_backward == "both" else []  # the pair differs in the fusion only
    common = [*fused, "--model", model, "--inner-optimizer", optimizer, "--batch-size", str(args.batch_size),
              "--seq-len", str(args.seq_len), "-H", str(args.inner_steps), "--max-rounds", str(args.rounds),
              "--threads", str(args.threads), "--device", args.device, "--eval-every", "0",
              "--run-id", f"mem-{model}-{optimizer}", "--checkpoint-every", str(args.checkpoint_every),
              "--compression", args.compression,
              "--checkpoint-dir", str(log_dir / "checkpoints")]
    first = start_process(peer_command("join", "--log-dir", str(log_dir), "--name", "peer0", *common),
                          log_dir / "peer0.log")
    sampler = PeakSampler(first.pid)
    sampler.start()
    others = []
    try:
        address = wait_for_file(log_dir / "peer0.addrs", first, timeout=300)
        others = [start_process(join_command(address, f"peer{i}", log_dir, *common), log_dir / f"peer{i}.log")
                  for i in range(1, args.peers)]
        first.wait(args.timeout)
    finally:
        sampler.stopped.set()
        for proc in (first, *others):
            stop_tree(proc)
    tag = f"{model}-{optimizer}" + ("-in-backward" if in_backward else "")
    if args.timeline:  # the samples, and the peer's own records (its rounds and checkpoints, by wall-clock time)
        with open(args.timeline.with_suffix(f".{tag}.jsonl"), "w") as f:
            f.writelines(json.dumps(dict(time=t, pss=sizes)) + "\n" for t, sizes in sampler.timeline)
        shutil.copy(log_dir / "peer0.jsonl", args.timeline.with_suffix(f".{tag}.peer0.jsonl"))
    summary = of_kind(read_records(log_dir / "peer0.jsonl"), Summary)
    n_params = sum_params(model)
    device_peak = summary[-1].device_peak_bytes if summary else None
    return dict(model=model, optimizer=optimizer, step_in_backward=in_backward, device=args.device, compression=args.compression, n_params=n_params,
                rounds=summary[-1].rounds if summary else None,
                tokens_per_s=round(summary[-1].tokens / max(summary[-1].training_seconds, 1e-9)) if summary else None,
                utilization=round(summary[-1].utilization, 3) if summary else None,
                host_peak_gb=round(sampler.peak / 1e9, 3), host_bytes_per_param=round(sampler.peak / n_params, 1),
                device_bytes_per_param=round(device_peak / n_params, 1) if device_peak else None,
                goal_host_bytes_per_param=GOALS["cuda" if args.device.startswith("cuda") else "cpu"][optimizer],
                by_process={k: round(v / 1e9, 3) for k, v in sampler.peak_by_process.items()})


def _print_slopes(rows: list) -> None:
    """What each further parameter costs: the slope between the smallest and the largest model measured, with
    the same optimizer. The processes' fixed cost (Python, torch, hivemind's helpers: ~0.7 GB) weighs on small
    models; the slope is what a 1B model pays per parameter."""
    for kind in dict.fromkeys((r["optimizer"], r["step_in_backward"]) for r in rows):
        optimizer = kind[0] + (" in backward" if kind[1] else "")
        mine = sorted((r for r in rows if (r["optimizer"], r["step_in_backward"]) == kind), key=lambda r: r["n_params"])
        if len(mine) >= 2 and mine[-1]["n_params"] > mine[0]["n_params"]:
            lo, hi = mine[0], mine[-1]
            slope = (hi["host_peak_gb"] - lo["host_peak_gb"]) * 1e9 / (hi["n_params"] - lo["n_params"])
            print(f"{optimizer}: {slope:.1f} host bytes per further parameter ({lo['model']} → {hi['model']}); "
                  f"goal {lo['goal_host_bytes_per_param']:.0f}")


def sum_params(model: str) -> int:
    from p2pdiloco.training.model import build_model

    return sum(p.numel() for p in build_model(model_config(model), 0).parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,base,medium,large")
    p.add_argument("--optimizers", default="adamw,adamw8bit")
    p.add_argument("--device", default="cpu")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--inner-steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--checkpoint-every", type=int, default=1, help="checkpoints are part of a peer's peak")
    p.add_argument("--compression", default="none", help="the rounds' wire format (none: 20-bit codes, the default)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--step-in-backward", choices=("off", "on", "both"), default="off",
                   help="step the inner optimizer inside the backward pass (needs --grad-clip 0, which 'both' uses "
                        "for the run without it too)")
    p.add_argument("--timeline", type=Path, default=None,
                   help="also write each size's samples (time, PSS per process) to TIMELINE.<model>-<optimizer>.jsonl")
    args = p.parse_args()
    rows = []
    for model in args.models.split(","):
        for optimizer in args.optimizers.split(","):
            for in_backward in {"off": [False], "on": [True], "both": [False, True]}[args.step_in_backward]:
                with tempfile.TemporaryDirectory() as tmp:
                    row = measure(model, optimizer, args, Path(tmp), in_backward)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'model':8} {'params':>11} {'optimizer':14} {'host GB':>8} {'host B/param':>13} {'goal':>5} "
          f"{'device B/param':>15} {'tokens/s':>9} {'util':>5}")
    for r in rows:
        device = "-" if r["device_bytes_per_param"] is None else f"{r['device_bytes_per_param']:.1f}"
        optimizer = r["optimizer"] + (" in bwd" if r["step_in_backward"] else "")
        print(f"{r['model']:8} {r['n_params']:>11,} {optimizer:14} {r['host_peak_gb']:>8.2f} "
              f"{r['host_bytes_per_param']:>13.1f} {r['goal_host_bytes_per_param']:>5.0f} {device:>15} "
              f"{r['tokens_per_s'] or 0:>9} {r['utilization'] or 0:>5.2f}")
    _print_slopes(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
