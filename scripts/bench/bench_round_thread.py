"""What a merged round costs the training thread, pass by pass, at a model's size (one process, no swarm).

After every round a peer's training thread steps Θ (`GlobalState.apply`: the outer step, then Θ's digest for
its history), learns how far the merge moved it (`saw_merge`) and publishes a sketch of Θ (`core.consensus`).
Each is a pass over a model-sized vector while no inner step runs. This times each pass on Θ and a momentum of
`--params` floats, with `--threads` torch threads, best of `--repeats`; and, side by side, the sketch as it was
before 2026-11-30 (a sign drawn per element), kept here as the baseline. Run as
    python scripts/bench/bench_round_thread.py [--params 100e6] [--threads 1] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from p2pdiloco.core.consensus import SKETCH_DIM, sketch
from p2pdiloco.core.exact import digest
from p2pdiloco.core.state import GlobalState

_SEED, _CHUNK = 0x5EED, 1 << 20  # the old sketch's draw


def sketch_drawn_per_element(x: torch.Tensor, k: int = SKETCH_DIM) -> list[float]:
    """The sketch before 2026-11-30: a random sign drawn for every element, scattered into its bucket."""
    n, out = x.numel(), torch.zeros(k, dtype=torch.float64)
    gen = torch.Generator().manual_seed(_SEED)
    for start in range(0, n, _CHUNK):
        chunk = x[start : start + _CHUNK].double()
        signs = torch.randint(0, 2, (chunk.numel(),), generator=gen, dtype=torch.int8).double() * 2 - 1
        index = torch.div(torch.arange(start, start + chunk.numel()) * k, n, rounding_mode="floor")
        out.index_add_(0, index, chunk * signs)
    return [float(v) for v in out]


def best_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.params)
    gen = torch.Generator().manual_seed(0)
    state = GlobalState(torch.randn(n, generator=gen), lr=0.7, momentum=0.6)
    merged = torch.randn(n, generator=gen).mul_(1e-3)
    seconds = dict(
        outer_step=best_of(args.repeats, lambda: state.outer.step(merged)),
        saw_merge=best_of(args.repeats, lambda: state.saw_merge(merged)),
        digest=best_of(args.repeats, lambda: digest(*state.outer.state_tensors())),
        sketch=best_of(args.repeats, lambda: sketch(state.params)),
        sketch_drawn_per_element=best_of(args.repeats, lambda: sketch_drawn_per_element(state.params)))
    result = dict(params=n, threads=args.threads, repeats=args.repeats, seconds=seconds,
                  ns_per_param={k: 1e9 * v / n for k, v in seconds.items()},
                  sketch_speedup=seconds["sketch_drawn_per_element"] / seconds["sketch"])
    for name, value in seconds.items():
        print(f"{name:>26}: {value:8.3f} s  ({1e9 * value / n:6.2f} ns a parameter)")
    print(f"the sketch now takes 1/{result['sketch_speedup']:.0f} of the per-element draw's time")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
