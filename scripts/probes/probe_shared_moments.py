"""Would sharing the learners' AdamW moments at each merge close the parity gap (issue 46, docs/parity.md)?

Most of the gap at a learner's batch of 8 x 128 tokens is local AdamW: each learner divides its steps by its own
second moment, which holds its own batch's gradient noise (about M times data-parallel's). This probe runs the
parity benchmark's synchronous row (`sim.parity`: each learner a peer's own DiLoCo, int4 rounds every H steps) and,
after each merge, rewrites every learner's moments:

  none  nothing (the benchmark's H<h>-int4 row)
  mv    m and v set to the learners' means
  mvc   m to the mean; v to the mean less the part of it that is one learner's batch noise beyond data-parallel's,
        (1 - 1/M) sigma^2, where sigma^2 = (1 + beta1) / (1 - beta1) * the learners' variance of m (m is an EMA of
        gradients, so its variance across learners is sigma^2 (1 - beta1) / (1 + beta1)); kept within [mean / M, mean]
  vc    v as in mvc, each learner keeping its own m

A peer cannot do this today: it would need its island to sum m and v as well as the pseudo-gradient (2 more
model-sized vectors a round). Nothing goes on the network.
  python scripts/probes/probe_shared_moments.py --mode mvc [--seed 0] [--steps 400] [-H 100] --out F.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.protocol.island import Bounds
from p2pdiloco.sim.learners import Wire
from p2pdiloco.sim.parity import Bench, Curve, Setup, diloco

MODES = ("none", "mv", "mvc", "vc")


def moments(learner) -> list[dict]:
    optimizer = learner.diloco.trainer.optimizer
    return [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]


def noise_free_v(ms: torch.Tensor, vs: torch.Tensor, step: float, beta1: float, beta2: float) -> torch.Tensor:
    """The learners' mean v less (1 - 1/M) of one batch's noise variance, estimated from the spread of their m."""
    m = ms.shape[0]
    sigma2 = ms.var(0, unbiased=True) * (1 + beta1) / (1 - beta1)
    mean = vs.mean(0)
    stored = mean - (1 - 1 / m) * sigma2 * (1 - beta2 ** step)  # v is stored without its bias correction
    return torch.maximum(torch.minimum(stored, mean), mean / m)


def share(group, mode: str, beta1: float, beta2: float) -> None:
    per_learner = [moments(learner) for learner in group]
    for states in zip(*per_learner):
        if "exp_avg" not in states[0]:
            continue
        ms = torch.stack([s["exp_avg"] for s in states])
        vs = torch.stack([s["exp_avg_sq"] for s in states])
        v = vs.mean(0) if mode == "mv" else noise_free_v(ms, vs, float(states[0]["step"]), beta1, beta2)
        for s in states:
            if mode != "vc":
                s["exp_avg"].copy_(ms.mean(0))
            s["exp_avg_sq"].copy_(v)


def run(bench: Bench, h: int, mode: str) -> Curve:
    """The benchmark's synchronous row (`sim.parity.diloco`), the moments rewritten after each merge."""
    s = bench.setup
    wire = Wire.named("int4", bounds=Bounds.of(OuterConfig()))
    after_merge = None if mode == "none" else (lambda group: share(group, mode, s.beta1, s.beta2))
    return diloco(bench, h, wire, after_merge=after_merge)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, default="mvc")
    p.add_argument("-H", "--inner-steps", type=int, default=100)
    p.add_argument("--steps", type=int, default=400, help="inner steps per learner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="runs/corpora/docs-en-8k", help="a prepared dataset (docs/parity.md)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    bench = Bench.load(Setup(data=(a.data,), steps=a.steps, seed=a.seed))
    started = time.time()
    curve = run(bench, a.inner_steps, a.mode)
    result = dict(mode=a.mode, h=a.inner_steps, seed=a.seed, steps=a.steps, tokens=curve.tokens, bpb=curve.bpb,
                  seconds=round(time.time() - started, 1))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("final", a.mode, curve.bpb[-1])


if __name__ == "__main__":
    main()
