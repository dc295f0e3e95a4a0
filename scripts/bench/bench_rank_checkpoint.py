"""What a sharded member's checkpoint costs rank 0, the optimizer's state gathered whole (as before 2026-12-01, and
as `InnerTrainer.optimizer_state` still reads it) against each rank writing its own part (`checkpoint.stage`, the
checkpoint's way now). Two gloo ranks shard a preset with --fsdp (FSDP2), train a few steps, then take one of the
two; each way runs in a fresh pair of processes, alternated, so that neither reuses the other's freed heap. Rank 0's
resident memory is sampled every 2 ms during the call: its peak above the moment before is what the checkpoint
cost it. Also timed: θ gathered whole into rank 0's mirror, which each contribution does (rank 0 encodes and sends
the member's round). No network beyond the ranks' own group on loopback files.
    .venv/bin/python scripts/bench/bench_rank_checkpoint.py --model large --repeats 2 --out F.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from p2pdiloco.config import InnerConfig
from p2pdiloco.training import checkpoint
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.diloco import trainer_checkpoint
from p2pdiloco.training.inner import InnerTrainer
from p2pdiloco.training.model import build_model
from p2pdiloco.training.ranks import Ranks, Strided, follow

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """The process's resident bytes, sampled every 2 ms while in the block: the peak above the start."""

    def __enter__(self):
        self.start = self.peak = resident()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, resident())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, resident())
        self.above = self.peak - self.start


def rank_main(rank: int, folder: str, model: str, way: str, steps: int) -> None:
    os.environ["WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)
    cfg = dataclasses.replace(InnerConfig(steps=steps, batch_size=1, seq_len=32, warmup_steps=1), fsdp=True)
    text = torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    ranks = Ranks(rank, 2)
    t = InnerTrainer(build_model(model, seed=rank), Strided(BatchStream(text, 1, 32, seed=1), ranks), cfg,
                     torch.device("cpu"), ranks=ranks)
    if rank != 0:
        follow(t)
        return
    for _ in range(steps):
        t.train_step()
    started = time.monotonic()
    t.model  # θ whole into rank 0's mirror first, as a contribution gathers it: both ways need it
    theta_seconds = time.monotonic() - started
    started = time.monotonic()
    with Peak() as peak:
        if way == "whole":
            moments, _ = t.optimizer_state()
            held = sum(v.numel() * v.element_size() for v in moments.values())
            del moments
        else:
            _, tensors = trainer_checkpoint(t)
            staged = checkpoint.stage(tensors, Path(folder) / "ck")[checkpoint.SHARDS]
            held = sum(p.stat().st_size for p in staged.path.glob("*.distcp"))  # written, by both ranks
    seconds = time.monotonic() - started
    t.release_ranks()
    n = sum(p.numel() for p in t.mirror.parameters())
    Path(folder, "result.json").write_text(json.dumps(dict(way=way, above_bytes=peak.above, seconds=seconds,
                                                           n_params=n, moments_bytes=held,
                                                           theta_gather_seconds=theta_seconds)))


def once(model: str, way: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        context = multiprocessing.get_context("fork")
        procs = [context.Process(target=rank_main, args=(r, folder, model, way, steps)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
            if p.exitcode != 0:
                raise SystemExit(f"a rank of the {way} run exited {p.exitcode}")
        return json.loads(Path(folder, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="large")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    a = parser.parse_args()
    runs = [once(a.model, way, a.steps) for _ in range(a.repeats) for way in ("whole", "files")]
    summary = {}
    for way in ("whole", "files"):
        mine = [r for r in runs if r["way"] == way]
        summary[way] = dict(above_bytes_median=statistics.median(r["above_bytes"] for r in mine),
                            seconds_median=statistics.median(r["seconds"] for r in mine),
                            theta_gather_seconds_median=statistics.median(r["theta_gather_seconds"] for r in mine))
        n = mine[0]["n_params"]
        print(f"{a.model} ({n / 1e6:.1f} M parameters), {way}: rank 0's peak rose "
              f"{summary[way]['above_bytes_median'] / 1e6:.0f} MB ({summary[way]['above_bytes_median'] / n:.2f} "
              f"bytes a parameter), in {summary[way]['seconds_median']:.2f} s (median of {len(mine)})")
    gathers = [r["theta_gather_seconds"] for r in runs]
    print(f"θ gathered whole into rank 0's mirror (what each contribution and checkpoint does first): "
          f"{statistics.median(gathers):.2f} s (median of {len(gathers)})")
    ratio = summary["files"]["above_bytes_median"] / max(1, summary["whole"]["above_bytes_median"])
    print(f"files / whole: {ratio:.3f} of the memory rank 0 took for the checkpoint's moments")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(model=a.model, steps=a.steps, runs=runs, summary=summary,
                                               files_over_whole=ratio), indent=1))


if __name__ == "__main__":
    main()
