"""The data-parallel baseline for bench_bandwidth: one rank of torch.distributed (gloo) all-reducing every
step's gradients (DDP), run inside a testbed peer's namespace. Prints one JSON line: seconds per step and the
bytes its network interface sent and received per step (kernel counters: what really went on the wire).

    python scripts/bench/dp_baseline.py --rank I --world N --master ADDR --iface vI [--steps 20] [--model tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from p2pdiloco.training.data import BatchStream, load_corpus
from p2pdiloco.training.model import build_model


def wire_bytes(iface: str) -> tuple[int, int]:
    stats = Path(f"/sys/class/net/{iface}/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--iface", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    a = parser.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = a.iface
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:29511", rank=a.rank, world_size=a.world)
    model = DistributedDataParallel(build_model(a.model, seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = BatchStream(load_corpus().train, a.batch_size, a.seq_len, seed=a.rank)
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            dist.barrier()
            started, before = time.monotonic(), wire_bytes(a.iface)
        inputs, targets = next(batches)
        loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here, over the testbed's link
        optimizer.step()
    seconds, after = time.monotonic() - started, wire_bytes(a.iface)
    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps(dict(rank=a.rank, step_seconds=seconds / a.steps, n_params=n_params,
                          tx_bytes_per_step=(after[0] - before[0]) / a.steps,
                          rx_bytes_per_step=(after[1] - before[1]) / a.steps,
                          tokens_per_step=a.batch_size * a.seq_len, loss=float(loss.detach()))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
