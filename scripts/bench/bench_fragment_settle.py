"""What applying a fragment's round outcome costs the training thread: one process, a preset's P fragments over one
trainer, each round merged alone (SoloMerger, no network), the time `DiLoCo.poll` takes to settle each outcome (the
outer step, the digest of Θ and the momentum, the rebase of θ) beside the inner steps' time.

    python scripts/bench/bench_fragment_settle.py --model small --fragments 8

For a before/after: run it with PYTHONPATH set to a checkout of the other commit (the script's own folder comes
first on sys.path, not the current directory)."""

import argparse
import time

import torch

from p2pdiloco.config import InnerConfig
from p2pdiloco.core.fragments import Stagger
from p2pdiloco.core.state import GlobalState
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.diloco import SoloMerger
from p2pdiloco.training.fragments import Streams
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--fragments", type=int, default=8)
    p.add_argument("-H", type=int, default=48)
    p.add_argument("--steps", type=int, default=96)
    a = p.parse_args()
    torch.set_num_threads(1)
    text = torch.randint(0, 256, (200_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    model = build_model(a.model, seed=0)
    cfg = InnerConfig(batch_size=4, seq_len=128, warmup_steps=0)
    trainer = InnerTrainer(model, BatchStream(text, cfg.batch_size, cfg.seq_len, seed=1), cfg, torch.device("cpu"))
    state = GlobalState(flat_params(model), lr=0.7, momentum=0.6)
    streams = Streams(trainer, state, lambda i, clock, part: SoloMerger(), Stagger(a.fragments, a.H), "me", "me")
    settle, steps, settled = 0.0, 0.0, 0
    for _ in range(a.steps):
        for i in streams.due():
            streams.contribute(i)
        started = time.perf_counter()
        streams.inner_step()
        steps += time.perf_counter() - started
        for i in list(streams.in_flight):
            streams.parts[i].in_flight.future.result()  # the merge itself is not the training thread's
            started = time.perf_counter()
            streams.parts[i].poll()
            settle += time.perf_counter() - started
            settled += 1
    n = sum(p.numel() for p in model.parameters())
    print(f"{a.model} ({n / 1e6:.1f} M parameters), P = {a.fragments}, H = {a.H}: {settled} outcomes settled, "
          f"{1000 * settle / max(1, settled):.1f} ms each; {a.steps} inner steps {steps:.1f} s; settling "
          f"{settle / (settle + steps):.4f} of the training thread's time")


if __name__ == "__main__":
    main()
