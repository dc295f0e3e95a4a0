"""What a peer's P fragments hold beside the global state it built: resident memory before `Streams` is built, after,
and once every fragment's momentum is written (as its first outer steps do), for one model preset, one process.

    python scripts/bench/bench_fragment_memory.py medium

For a before/after: run it with PYTHONPATH set to a checkout of the other commit (the script's own folder comes
first on sys.path, not the current directory)."""

import gc
import os
import resource
import sys

import torch

from p2pdiloco.config import InnerConfig
from p2pdiloco.core.fragments import Stagger
from p2pdiloco.core.state import GlobalState
from p2pdiloco.training.diloco import SoloMerger
from p2pdiloco.training.fragments import Streams
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model


def resident_mb() -> float:
    gc.collect()
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main(preset: str) -> None:
    torch.set_num_threads(1)
    model = build_model(preset, seed=0)
    n = sum(p.numel() for p in model.parameters())
    trainer = InnerTrainer(model, iter(()), InnerConfig(batch_size=1, seq_len=16, warmup_steps=0),
                           torch.device("cpu"))
    theta = flat_params(model)
    state = GlobalState(theta, lr=0.7, momentum=0.6, storage=(theta, torch.zeros_like(theta)))  # as a peer builds it
    before = resident_mb()
    streams = Streams(trainer, state, lambda i, clock, s: SoloMerger(), Stagger(8, 64), "me", "me")
    after = resident_mb()
    for part in streams.parts:  # what the first outer steps write: every fragment's momentum
        part.state.outer.momentum_buffer.fill_(1.0)
    used = resident_mb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{preset}: {n / 1e6:.1f} M params, P = 8; resident before Streams {before:.0f} MB, after {after:.0f} MB, "
          f"with every momentum written {used:.0f} MB; peak {peak:.0f} MB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "medium")
