"""What a stale member's merge weight should keep: DiLoCo in one process, with members that miss rounds on a schedule.

M workers train the built-in data with the peer's own pieces (model, AdamW inner steps, token weights capped and
cut as an island does, Nesterov outer step). Every `--miss-every` rounds one worker (in turn) misses its round: it
trains on from its local model, and at the next round it contributes one Δ from the version before, carrying both
rounds' steps: what a member does whose round failed while the others merged. Each variant runs the same seeds,
data and schedule, differing only in `--stale-factor` (what such a member's weight keeps per version behind); the
variant `whole` has no misses (every worker in every round) as the reference. One lineage, no forks: this isolates
the merge rule from matchmaking, which `bench_swarm_vs_solo.py` does not.
Reports per variant the validation loss of Θ after the last round (mean and spread over seeds) and its paired
difference to the variant with stale factor 1 (no discount).
Usage: python scripts/bench/bench_staleness.py [--factors 1,0.5,0.25] [--seeds 0,1,2] [--rounds 12] [-H 25] [--model tiny]
       [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from p2pdiloco.config import InnerConfig
from p2pdiloco.core.outer import OuterOptimizer
from p2pdiloco.protocol.island import Bounds, member_weights
from p2pdiloco.training.data import BatchStream, load_corpus, validation_batches
from p2pdiloco.training.inner import InnerTrainer, evaluate, flat_params, load_flat_params
from p2pdiloco.training.model import build_model


class Worker:
    def __init__(self, index: int, seed: int, a, corpus, theta: torch.Tensor):
        model = build_model(a.model, seed)
        load_flat_params(model, theta)
        cfg = InnerConfig(batch_size=a.batch_size, seq_len=a.seq_len)
        stream = BatchStream(corpus.train, cfg.batch_size, cfg.seq_len, seed=1000 * seed + index)
        self.trainer = InnerTrainer(model.to(a.device), iter(stream), cfg, torch.device(a.device))
        self.base, self.version, self.steps = theta.clone(), 0, 0  # the Θ its Δ is taken from

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.trainer.train_step()
        self.steps += steps

    def delta(self) -> torch.Tensor:
        return self.base - flat_params(self.trainer.model)

    def adopt(self, theta: torch.Tensor, version: int) -> None:
        load_flat_params(self.trainer.model, theta)
        self.base, self.version, self.steps = theta.clone(), version, 0


def run(factor: float | None, seed: int, a, corpus, val) -> list[float]:
    """Val loss of Θ after each round. `factor` None: the reference without misses."""
    torch.manual_seed(seed)
    model = build_model(a.model, seed)
    theta = flat_params(model).clone()  # Θ and the outer step on the CPU, as on a peer
    model.to(a.device)
    outer = OuterOptimizer(theta, a.outer_lr, a.outer_momentum)
    workers = [Worker(i, seed, a, corpus, theta) for i in range(a.workers)]
    bounds = Bounds(stale_factor=1.0 if factor is None else factor)
    curve = []
    for r in range(a.rounds):
        for w in workers:
            w.train(a.inner_steps)
        missing = {(r // a.miss_every) % a.workers} if factor is not None and r % a.miss_every == a.miss_every - 1 \
            else set()
        members = [w for i, w in enumerate(workers) if i not in missing]
        deltas = [w.delta() for w in members]
        tokens = [w.steps * a.batch_size * a.seq_len for w in members]
        weights, _ = member_weights(tokens, [w.steps for w in members], [float(d.norm()) for d in deltas],
                                    [w.version for w in members], "tokens2", bounds)
        outer.step(sum(wt * d for wt, d in zip(weights, deltas)))
        for w in members:
            w.adopt(theta, r + 1)
        curve.append(evaluate(model, val, torch.device(a.device), params=theta))
    return curve


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--factors", default="1,0.5,0.25")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("-H", "--inner-steps", type=int, default=25)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--miss-every", type=int, default=2, help="one worker misses every this many rounds")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="the workers' inner steps (cuda: bf16 autocast, as a peer)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    corpus = load_corpus()
    val = validation_batches(corpus.val, 8, a.batch_size, a.seq_len)
    variants = {"whole": None, **{f"stale_factor={float(f):g}": float(f) for f in a.factors.split(",")}}
    seeds = [int(s) for s in a.seeds.split(",")]
    curves = {}
    for name, factor in variants.items():
        started = time.monotonic()
        curves[name] = [run(factor, seed, a, corpus, val) for seed in seeds]
        print(f"{name}: final {[round(c[-1], 4) for c in curves[name]]} ({time.monotonic() - started:.0f} s)",
              flush=True)
    undiscounted = next((n for n, f in variants.items() if f == 1.0), None)
    result = dict(settings=vars(a), variants={})
    for name, runs in curves.items():
        finals = [c[-1] for c in runs]
        entry = dict(final_val_mean=round(statistics.mean(finals), 4), spread=round(max(finals) - min(finals), 4),
                     finals=[round(x, 4) for x in finals],
                     mean_curve=[round(statistics.mean(c[i] for c in runs), 4) for i in range(a.rounds)])
        if undiscounted and name != undiscounted:
            paired = [x / y - 1 for x, y in zip(finals, (c[-1] for c in curves[undiscounted]))]
            entry["vs_stale_factor_1_pct"] = [round(100 * d, 2) for d in paired]
        result["variants"][name] = entry
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
