"""Peak host memory per parameter of one peer, per model size, side by side with the goals (issue 13).

Each size runs a 2-peer local swarm (so rounds really average: the wire buffers and the all-reduce are in the
peak) for a few short rounds; the first peer's whole process tree (the training process, its averager process,
the p2p daemon) is sampled every 50 ms. The figure is PSS (proportional set size): a page shared between the
host and its averager (hivemind shares the averaged tensors) counts once, not once per process, and the pages
of torch's libraries are split among the processes that map them, the other peer's included: so "alone GB",
measured near the PSS peaks as root, counts every page of the tree once, shared or not (p2pdiloco.ops.residency):
what the peer needs on a machine of its own. Device memory, on a GPU peer, comes from the peer's own metrics
(torch.cuda.max_memory_allocated).

Usage: python scripts/bench/bench_memory.py [--models tiny,base,medium,large] [--optimizers adamw,adamw8bit]
       [--batch-size 4] [--device cpu] [--peers 2] [--compression none|int8|int4|int2]
       [--variants plain,in-backward,on-disk,in-backward+on-disk]   (each size once per variant, alternately)
Needs no root (but "alone GB" does); run it inside `unshare -n` (loopback only) like the tests, or not: peers listen
on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional
from p2pdiloco.ops.launcher import join_command, peer_command, start_process, stop_tree, wait_for_file
from p2pdiloco.ops.residency import pss_kinds, union_bytes
from p2pdiloco.runtime.lifeline import descendants
from p2pdiloco.runtime.schema import Summary, of_kind, read_records

GOALS = {"cpu": {"adamw": 32.0, "adamw8bit": 20.0}, "cuda": {"adamw": 12.0, "adamw8bit": 12.0}}


class PeakSampler(threading.Thread):
    """The peak of the summed PSS of a process and all its descendants, sampled until stopped."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak, self.stopped = pid, interval, 0, threading.Event()
        self.peak_by_process: dict = {}
        self.alone_peak, self._next_alone = 0, 0.0  # None: not measurable (pagemap's frames need root)
        self.charged_elsewhere = 0  # the most PSS charged to processes outside the tree, at a sample near a peak
        self.timeline: list = []  # (wall-clock time, {process: PSS}, {process: its anonymous part}): where the
        # peak came from, and how much of it was heap rather than files mapped

    def run(self) -> None:
        while not self.stopped.is_set():
            pids = [self.pid, *descendants(self.pid)]
            kinds = {pid: pss_kinds(pid) for pid in pids}
            sizes = {pid: k.get("Pss", 0) for pid, k in kinds.items()}
            self.timeline.append((round(time.time(), 3), {_name(p): s for p, s in sizes.items() if s},
                                  {_name(p): k["Pss_Anon"] for p, k in kinds.items() if k.get("Pss_Anon")}))
            total = sum(sizes.values())
            if total > self.peak:
                self.peak, self.peak_by_process = total, {_name(p): s for p, s in sizes.items() if s}
            if total >= 0.97 * self.peak:
                self._measure_alone(pids, total)
            time.sleep(self.interval)

    def _measure_alone(self, pids: list, pss_total: int) -> None:
        """Near each PSS peak, at most every 2 s (a sample costs ~0.7 s of CPU for 2 GB): the tree's pages each
        counted once, shared or not (ops.residency), and how much more that is than its PSS at the moment: the
        part of shared pages PSS charged to other processes (the other peer's). A peak shorter than 2 s may fall
        between these samples; the PSS peak plus the largest such part stands in for it (`alone_gb`)."""
        if self.alone_peak is None or time.monotonic() < self._next_alone:
            return
        try:
            union = union_bytes(pids)
        except PermissionError as e:
            print(f"not measured alone: {e}", file=sys.stderr)
            self.alone_peak = None
            return
        self.alone_peak = max(self.alone_peak, union)
        self.charged_elsewhere = max(self.charged_elsewhere, union - pss_total)
        self._next_alone = time.monotonic() + 2.0

    @property
    def alone_gb(self) -> Optional[float]:
        """What the peer would peak at on a machine of its own: measured, or the PSS peak with what PSS charged to
        other processes put back, whichever is larger."""
        if not self.alone_peak:
            return None
        return round(max(self.alone_peak, self.peak + self.charged_elsewhere) / 1e9, 3)


class MemoryLimit:
    """A memory cgroup (v1 or v2; needs root) that holds the first peer's process tree to `limit` bytes, page
    cache included, as a machine of that size would: the kernel reclaims file pages inside it (a parked global
    state's, once written back) and kills the peer when what cannot be reclaimed does not fit (no swap here)."""

    def __init__(self, limit: int, name: str):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        self.path = Path("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory") / name
        self.files = dict(limit="memory.max", peak="memory.peak", events="memory.events") if v2 else \
            dict(limit="memory.limit_in_bytes", peak="memory.max_usage_in_bytes", events="memory.oom_control")
        try:
            self.path.mkdir()
            (self.path / self.files["limit"]).write_text(str(limit))
        except OSError as e:
            raise SystemExit(f"--memory-limit needs root and a memory cgroup at {self.path.parent} ({e})") from None

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # before it forks: its helpers are held too

    def result(self) -> dict:
        events = dict(line.split() for line in (self.path / self.files["events"]).read_text().splitlines())
        peak = self.path / self.files["peak"]
        return dict(cgroup_peak_gb=round(int(peak.read_text()) / 1e9, 3) if peak.exists() else None,
                    oom_kills=int(events.get("oom_kill", 0)))

    def remove(self) -> None:
        for _ in range(50):  # the killed tree's last exits are reaped a moment later
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _name(pid: int) -> str:
    try:
        return f"{pid}:{Path(f'/proc/{pid}/comm').read_text().strip()}"
    except OSError:
        return str(pid)


# what a variant adds to a peer's flags; variants join them with '+' ("in-backward+on-disk"), "plain" has none
FEATURES = {"in-backward": ["--step-in-backward"], "on-disk": ["--global-state-on-disk"],
            "recompute": ["--activation-checkpointing"]}


def features(variant: str) -> list[str]:
    names = [] if variant == "plain" else variant.split("+")
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise SystemExit(f"unknown variant feature {unknown[0]!r}: plain, or {', '.join(FEATURES)} joined by '+'")
    return names


def measure(model: str, optimizer: str, args, log_dir: Path, variant: str = "plain") -> dict:
    flags = [flag for name in features(variant) for flag in FEATURES[name]]
    # where any variant steps inside the backward pass, all run without clipping: they differ in that only
    clip = ["--grad-clip", "0"] if any("in-backward" in features(v) for v in args.variants) else []
    common = [*clip, *flags, "--model", model, "--inner-optimizer", optimizer, "--batch-size", str(args.batch_size),
              "--seq-len", str(args.seq_len), "-H", str(args.inner_steps), "--max-rounds", str(args.rounds),
              "--threads", str(args.threads), "--device", args.device, "--eval-every", "0",
              "--run-id", f"mem-{model}-{optimizer}", "--checkpoint-every", str(args.checkpoint_every),
              "--compression", args.compression, "--quorum", str(args.quorum or args.peers),
              "--checkpoint-dir", str(log_dir / "checkpoints")]
    limit = MemoryLimit(int(args.memory_limit * 1e9), f"p2pdiloco-bench-{os.getpid()}-{log_dir.name}") \
        if args.memory_limit else None
    first = start_process(peer_command("join", "--log-dir", str(log_dir), "--name", "peer0", *common),
                          log_dir / "peer0.log")
    if limit is not None:
        limit.add(first.pid)
    sampler = PeakSampler(first.pid)
    sampler.start()
    others = []
    try:
        address = wait_for_file(log_dir / "peer0.addrs", first, timeout=300)
        others = [start_process(join_command(address, f"peer{i}", log_dir, *common), log_dir / f"peer{i}.log")
                  for i in range(1, args.peers)]
        try:
            first.wait(args.timeout)
        except subprocess.TimeoutExpired:  # its peak so far is still worth a row (flagged by its exit code)
            print(f"{model}: the first peer ran past --timeout {args.timeout:g} s; stopped", file=sys.stderr)
    finally:
        sampler.stopped.set()
        for proc in (first, *others):
            stop_tree(proc)
        held = limit.result() if limit is not None else {}
        if limit is not None:
            limit.remove()
    tag = f"{model}-{optimizer}" + ("" if variant == "plain" else f"-{variant}")
    if args.timeline:  # the samples, and the peer's own records (its rounds and checkpoints, by wall-clock time)
        with open(args.timeline.with_suffix(f".{tag}.jsonl"), "w") as f:
            f.writelines(json.dumps(dict(time=t, pss=sizes, anon=anon)) + "\n" for t, sizes, anon in sampler.timeline)
        shutil.copy(log_dir / "peer0.jsonl", args.timeline.with_suffix(f".{tag}.peer0.jsonl"))
        for i in range(args.peers):  # their text logs too: what a peak's moment was (a download served, a retry)
            shutil.copy(log_dir / f"peer{i}.log", args.timeline.with_suffix(f".{tag}.peer{i}.log"))
    summary = of_kind(read_records(log_dir / "peer0.jsonl"), Summary)
    n_params = sum_params(model)
    device_peak = summary[-1].device_peak_bytes if summary else None
    return dict(model=model, optimizer=optimizer, variant=variant, device=args.device, compression=args.compression,
                n_params=n_params,
                rounds=summary[-1].rounds if summary else None,
                tokens_per_s=round(summary[-1].tokens / max(summary[-1].training_seconds, 1e-9)) if summary else None,
                utilization=round(summary[-1].utilization, 3) if summary else None,
                host_peak_gb=round(sampler.peak / 1e9, 3), host_bytes_per_param=round(sampler.peak / n_params, 1),
                host_peak_alone_gb=sampler.alone_gb,
                host_alone_measured_gb=round(sampler.alone_peak / 1e9, 3) if sampler.alone_peak else None,
                host_charged_elsewhere_gb=round(sampler.charged_elsewhere / 1e9, 3),
                device_bytes_per_param=round(device_peak / n_params, 1) if device_peak else None,
                goal_host_bytes_per_param=GOALS["cuda" if args.device.startswith("cuda") else "cpu"][optimizer],
                by_process={k: round(v / 1e9, 3) for k, v in sampler.peak_by_process.items()},
                memory_limit_gb=args.memory_limit, exit_code=first.returncode, **held)


def _print_slopes(rows: list) -> None:
    """What each further parameter costs: the slope between the smallest and the largest model measured, with
    the same optimizer. The processes' fixed cost (Python, torch, hivemind's helpers: ~0.7 GB) weighs on small
    models; the slope is what a 1B model pays per parameter."""
    for kind in dict.fromkeys((r["optimizer"], r["variant"]) for r in rows):
        optimizer = kind[0] + ("" if kind[1] == "plain" else f" {kind[1]}")
        mine = sorted((r for r in rows if (r["optimizer"], r["variant"]) == kind), key=lambda r: r["n_params"])
        if len(mine) >= 2 and mine[-1]["n_params"] > mine[0]["n_params"]:
            lo, hi = mine[0], mine[-1]
            slope = (hi["host_peak_gb"] - lo["host_peak_gb"]) * 1e9 / (hi["n_params"] - lo["n_params"])
            print(f"{optimizer}: {slope:.1f} host bytes per further parameter ({lo['model']} → {hi['model']}); "
                  f"goal {lo['goal_host_bytes_per_param']:.0f}")


def _within_limit(r: dict) -> str:
    if not r["memory_limit_gb"]:
        return ""
    trained = r["exit_code"] == 0 and r["rounds"] is not None
    outcome = "trained" if trained else f"failed (exit {r['exit_code']})"
    return (f"  in {r['memory_limit_gb']:g} GB: {outcome}, {r['oom_kills']} OOM kill(s), "
            f"cgroup peak {r['cgroup_peak_gb']} GB")


def sum_params(model: str) -> int:
    from p2pdiloco.training.model import build_model

    return sum(p.numel() for p in build_model(model, 0).parameters())


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
    p.add_argument("--quorum", type=int, default=None,
                   help="fewest members for a round to merge (default: --peers, so the peak measured is a real round's, "
                        "not a lone first peer's)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--variants", default=None,
                   help="comma-separated, each size and optimizer once per variant, alternately: plain, or features "
                        f"joined by '+' ({', '.join(FEATURES)}: --step-in-backward, --global-state-on-disk); "
                        "where one steps in the backward pass, every variant runs with --grad-clip 0")
    p.add_argument("--step-in-backward", choices=("off", "on", "both"), default="off",
                   help="the same as --variants plain, in-backward, or plain,in-backward")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                   help="run the first peer in a memory cgroup of this size (root): does it train within it?")
    p.add_argument("--timeline", type=Path, default=None,
                   help="also write each size's samples (time, PSS per process) to TIMELINE.<model>-<optimizer>.jsonl")
    args = p.parse_args()
    args.variants = (args.variants.split(",") if args.variants else
                     {"off": ["plain"], "on": ["in-backward"], "both": ["plain", "in-backward"]}[args.step_in_backward])
    for variant in args.variants:
        features(variant)  # a typo ends the run now, not after the first hour of measuring
    if args.timeline:  # likewise a missing folder: it would fail only once the first size had been measured
        args.timeline.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models.split(","):
        for optimizer in args.optimizers.split(","):
            for variant in args.variants:
                with tempfile.TemporaryDirectory() as tmp:
                    row = measure(model, optimizer, args, Path(tmp), variant)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'model':8} {'params':>11} {'optimizer':30} {'host GB':>8} {'alone GB':>9} {'host B/param':>13} {'goal':>5} "
          f"{'device B/param':>15} {'tokens/s':>9} {'util':>5}")
    for r in rows:
        device = "-" if r["device_bytes_per_param"] is None else f"{r['device_bytes_per_param']:.1f}"
        optimizer = r["optimizer"] + ("" if r["variant"] == "plain" else f" {r['variant']}")
        alone = "-" if r["host_peak_alone_gb"] is None else f"{r['host_peak_alone_gb']:.2f}"
        print(f"{r['model']:8} {r['n_params']:>11,} {optimizer:30} {r['host_peak_gb']:>8.2f} {alone:>9} "
              f"{r['host_bytes_per_param']:>13.1f} {r['goal_host_bytes_per_param']:>5.0f} {device:>15} "
              f"{r['tokens_per_s'] or 0:>9} {r['utilization'] or 0:>5.2f}{_within_limit(r)}")
    _print_slopes(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
