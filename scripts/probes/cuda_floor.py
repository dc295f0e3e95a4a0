"""What a GPU training process costs in host memory before any of DiLoCo's state: torch, CUDA's context and
libraries, one model's inner steps (issue 13's GPU goal counts host bytes per parameter, and this is the part
that does not grow with the model).

One process, measured after each stage by PSS (its own pages, and its share of pages mapped elsewhere too),
split into anonymous pages (heaps, the driver's own allocations, pinned buffers) and file pages (libraries),
and at the end the mappings that hold the most. Run it alone on the machine: PSS splits a library's pages with
every other process that maps them.
  python scripts/probes/cuda_floor.py [--model large] [--steps 3] [--device cuda|cpu] [--out floor.json]
Nothing goes on the network."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

from p2pdiloco.config import InnerConfig
from p2pdiloco.ops.residency import pss_by_mapping, pss_kinds
from p2pdiloco.runtime.heap import give_back_free_heap
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.inner import InnerTrainer, bitsandbytes
from p2pdiloco.training.model import build_model

GB = 1e9


def measure(stage: str, rows: list) -> None:
    kinds = pss_kinds(os.getpid())
    row = {"stage": stage, "pss_gb": round(kinds["Pss"] / GB, 3), "anon_gb": round(kinds["Pss_Anon"] / GB, 3),
           "file_gb": round(kinds["Pss_File"] / GB, 3)}
    rows.append(row)
    print(json.dumps(row), flush=True)


def train(model, optimizer: str, args, rows: list) -> None:
    cfg = InnerConfig(batch_size=args.batch_size, seq_len=args.seq_len, optimizer=optimizer)
    text = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)  # random bytes: what is learnt does not matter here
    batches = BatchStream(text, args.batch_size, args.seq_len, seed=0)
    trainer = InnerTrainer(model, batches, cfg, torch.device(args.device))
    for _ in range(args.steps):
        trainer.train_step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    measure(f"{args.steps} inner steps, {optimizer}", rows)
    del trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="large")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default="cuda", help="cpu: the same stages without CUDA, for comparison")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows: list = []
    measure("python, torch and p2pdiloco imported", rows)
    bitsandbytes()
    measure("+ bitsandbytes", rows)
    if args.device == "cuda":
        torch.zeros(1, device="cuda")
        measure("+ CUDA context", rows)
    started = time.perf_counter()
    model = build_model(args.model, seed=0).to(args.device)
    measure(f"+ {args.model} on the {args.device}", rows)
    for optimizer in ("adamw", "adamw8bit"):
        train(model, optimizer, args, rows)
    give_back_free_heap()  # what of the heaps above was free, kept by glibc (as a peer does after each round)
    measure("+ the heaps' free pages given back (malloc_trim)", rows)
    mappings = sorted(pss_by_mapping(os.getpid()).items(), key=lambda kv: -kv[1]["pss"])
    top = [{"mapping": name, "pss_gb": round(v["pss"] / GB, 3), "anon_gb": round(v["anon"] / GB, 3)}
           for name, v in itertools.islice(mappings, args.top)]
    for row in top:
        print(json.dumps(row))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": device, "torch": torch.__version__, "model": args.model,
              "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"), "stages": rows, "largest_mappings": top,
              "seconds": round(time.perf_counter() - started, 1)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
