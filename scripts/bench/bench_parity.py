"""Does the swarm learn as well as data-parallel at equal tokens? Rows side by side, in one process, same model,
data, initial weights and inner hyper-parameters in every row (p2pdiloco.sim.parity):

  dp                 AdamW at every step over M× the batch
  H<h>-<wire>        M learners, each a peer's own DiLoCo (p2pdiloco.sim.learners), synchronous rounds every h
                     steps, merged on <wire>: fp32 (20-bit codes), int8, int4, int2 or topk2 (top 2 % on int2,
                     with peers/slow-uplink.toml's error-feedback decay 0.95, outer lr 3 and momentum 0)
  solo-H<h>-<wire>   one learner alone (solo rounds), M× fewer tokens: what a volunteer gets without a swarm,
                     at equal wall-clock
  dec-H<h>-<wire>    M learners, one 3× slower, merging without a barrier on a simulated clock by a peer's
                     default round rules (p2pdiloco.sim.timeline): late contributions are merged stale
Any row takes modifiers, each -<name><value>: -stale<f> (the merge's stale factor), -olr<f> and -om<f> (outer lr
and momentum), -ilr<f> (inner lr); decoupled rows also -slow<f> (the last learner's slowness, 3 by default; 1: all
equal), -sync<f> (an all-reduce's simulated seconds, 2 by default; a step is 1) and -tau<n> (τ of the grace
window, Eq. 3: H by default, as a peer's --overlap-steps); e.g. dec-H100-int4-stale0.5,
H100-int4-olr1.0-om0.8, dec-H100-int4-slow1-sync120 (rounds longer than H steps: every Δ a round late).
Synchronous rows take -frag<P> (Streaming DiLoCo: P fragments on staggered rounds, p2pdiloco.sim.parity.streaming),
-ov<n> (a fragment's round waited for n steps after it left; 0 by default) and -inflight<n> (τ: 2 by default),
e.g. H100-int4-frag8, H100-int4-frag8-ov5.

Reports validation bits per byte at the end of each row (mean and spread over seeds) and each row's difference to
`dp` at equal tokens (paired by seed), writes the JSON as it goes (a row at a time) and a PNG of bits per byte
against tokens.

Usage: python scripts/bench/bench_parity.py [--rows dp,H100-int4,...] [--seeds 0,1,2] [--steps 400] [--learners 4]
       [--data runs/corpora/docs-en-8k] [--model tiny] [--device cuda] [--out docs/bench/parity.json] [--plot docs/bench/parity.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
from pathlib import Path

import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.sim.learners import Wire
from p2pdiloco.training.model import rda_segments
from p2pdiloco.protocol.island import Bounds
from p2pdiloco.sim.parity import Bench, Curve, Setup, data_parallel, decoupled, diloco, streaming

ROW = re.compile(r"^(?:dp|(solo-|dec-)?H(\d+)-(fp32|int8|int4|int2|topk2))((?:-(?:stale|olr|om|ilr|sync|slow|tau|frag|ov|inflight|first)[0-9.]+|-rda)*)$")
SETUP_MODIFIERS = {"olr": "outer_lr", "om": "outer_momentum", "ilr": "inner_lr"}


def parse_row(row: str) -> tuple[str, int, str, dict]:
    """(kind, H, wire, modifiers) of a row's name; SystemExit naming what is allowed."""
    match = ROW.match(row)
    if not match:
        raise SystemExit(f"unknown row {row!r}: dp, H<steps>-<fp32|int8|int4|int2|topk2>, solo-H<steps>-<wire> or "
                         "dec-H<steps>-<wire>, each with optional -ilr<f> (the only one dp takes), -stale<f>, -olr<f>, -om<f>, -ilr<f> (dec: -slow<f>, -sync<f>, -tau<n>; "
                         "synchronous: -first<n>, or -frag<P>, -ov<n>, -inflight<n>; -rda: a peer's --rda)")
    kind, h, wire, mods = match.groups()
    modifiers = {name: float(value) for name, value in re.findall(r"-(stale|olr|om|ilr|sync|slow|tau|frag|ov|inflight|first)([0-9.]+)", mods or "")}
    if re.search(r"-rda(?:-|$)", mods or ""):
        modifiers["rda"] = 1.0
    kind = "dp" if row.startswith("dp") else (kind or "sync-").rstrip("-")
    streamed = {"frag", "ov", "inflight"} & set(modifiers)
    if streamed and "rda" in modifiers:
        raise SystemExit(f"row {row!r}: -rda is for whole-model rounds, not with -frag")
    if streamed and (kind != "sync" or "frag" not in modifiers or modifiers["frag"] < 1):
        raise SystemExit(f"row {row!r}: -frag<P> (P at least 1), -ov and -inflight are for synchronous rows, "
                         "-ov and -inflight with -frag")
    if kind == "dp":
        if set(modifiers) - {"ilr"}:
            raise SystemExit(f"row {row!r}: a dp row takes only -ilr<f> (its inner lr)")
        return "dp", 0, "", modifiers
    return kind, int(h), wire, modifiers


# a wire's own outer step, where a peer's profile gives one (peers/slow-uplink.toml: SparseLoCo's rounds)
WIRE_OUTER = {"topk2": {"olr": 3.0, "om": 0.0}}


def run_row(row: str, bench: Bench, count: str = "merged") -> Curve:
    kind, h, wire_name, modifiers = parse_row(row)
    modifiers = {**WIRE_OUTER.get(wire_name, {}), **modifiers}
    changes = {SETUP_MODIFIERS[k]: v for k, v in modifiers.items() if k in SETUP_MODIFIERS}
    if changes:
        bench = dataclasses.replace(bench, setup=dataclasses.replace(bench.setup, **changes))
    if kind == "dp":
        return data_parallel(bench)
    bounds = Bounds.of(OuterConfig())  # a peer's, the -stale modifier apart
    if "stale" in modifiers:
        bounds = dataclasses.replace(bounds, stale_factor=modifiers["stale"])
    wire = Wire.named(wire_name, bounds=bounds)
    if "rda" in modifiers:  # a peer's --rda: every tensor but the embeddings and the head
        wire = dataclasses.replace(wire, rda_segments=tuple(rda_segments(bench.model(bench.setup.seed))))
    if kind == "dec":
        speeds = (1.0,) * (bench.setup.learners - 1) + (modifiers.get("slow", 3.0),)
        tau = modifiers.get("tau")
        return decoupled(bench, h, wire, speeds=speeds, sync_seconds=modifiers.get("sync", 2.0),
                         overlap_steps=int(tau) if tau else None, count=count)
    if "frag" in modifiers:
        return streaming(bench, h, wire, int(modifiers["frag"]), overlap=int(modifiers.get("ov", 0)),
                         in_flight=int(modifiers.get("inflight", 2)))
    first = int(modifiers["first"]) if "first" in modifiers else None
    return diloco(bench, h, wire, m=1 if kind == "solo" else None, first=first)


def summarize(curves: dict[str, dict[int, Curve]]) -> dict:
    rows = {}
    dp = curves.get("dp", {})
    for row, by_seed in curves.items():
        finals = [c.final for c in by_seed.values()]
        entry = dict(final_bpb_mean=round(statistics.mean(finals), 4), spread=round(max(finals) - min(finals), 4),
                     finals={seed: c.final for seed, c in by_seed.items()}, tokens=next(iter(by_seed.values())).tokens[-1],
                     curves={seed: dict(tokens=c.tokens, bpb=c.bpb, **c.notes) for seed, c in by_seed.items()})
        paired = [by_seed[s].final / dp[s].final - 1 for s in by_seed if s in dp and row != "dp"
                  and dp[s].tokens[-1] == by_seed[s].tokens[-1]]
        if paired:
            entry["vs_dp_pct"] = [round(100 * d, 2) for d in paired]
            entry["vs_dp_pct_mean"] = round(100 * statistics.mean(paired), 2)
        rows[row] = entry
    return rows


def plot(curves: dict[str, dict[int, Curve]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for row, by_seed in curves.items():
        runs = list(by_seed.values())
        n = min(len(c.bpb) for c in runs)
        mean = [statistics.mean(c.bpb[i] for c in runs) for i in range(n)]
        ax.plot([t / 1e6 for t in runs[0].tokens[:n]], mean, marker=".", label=row, linestyle="--" if row == "dp" else "-")
    ax.set_xlabel("tokens trained, all learners (M)")
    ax.set_ylabel("validation bits per byte")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def curves_in(paths: list[str]) -> dict[str, dict[int, Curve]]:
    """The curves of earlier runs' JSON (several runs' rows side by side; a later file's row of a seed wins)."""
    curves: dict[str, dict[int, Curve]] = {}
    for path in paths:
        for row, entry in json.loads(Path(path).read_text())["rows"].items():
            for seed, c in entry["curves"].items():
                curves.setdefault(row, {})[int(seed)] = Curve(c["tokens"], c["bpb"])
    return curves


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plot-from", default="", help="draw --plot from these runs' JSON (comma-separated): no training")
    p.add_argument("--plot-rows", default="", help="with --plot-from: only these rows (comma-separated)")
    p.add_argument("--title", default="")
    p.add_argument("--rows", default="dp,H100-int4,H100-fp32,H50-int4,H100-topk2,solo-H100-int4")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=400, help="inner steps per learner (dp: steps of M× the batch)")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--data", default="", help="prepared dataset(s), comma-separated (default: the built-in corpus)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--inner-lr", type=float, default=1e-3)
    p.add_argument("--grad-clip", type=float, default=Setup.grad_clip, help="every row's (0: none); default: a peer's")
    p.add_argument("--beta1", type=float, default=Setup.beta1, help="every row's AdamW β1; default: a peer's")
    p.add_argument("--beta2", type=float, default=Setup.beta2, help="every row's AdamW β2; default: a peer's")
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine", "wsd"),
                   help="the inner lr after warm-up, decaying over the row's token budget as a swarm's --total-tokens")
    p.add_argument("--min-lr-ratio", type=float, default=Setup.min_lr_ratio)
    p.add_argument("--outer-lr", type=float, default=Setup.outer_lr, help="default: a peer's")
    p.add_argument("--outer-momentum", type=float, default=Setup.outer_momentum, help="default: a peer's")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--count", default="merged", choices=("merged", "trained"),
                   help="decoupled rows: tokens merged into the global model (default; the learners train on until "
                        "it holds the budget) or tokens trained, merged or not (a run then ends with a round's worth "
                        "unmerged)")
    p.add_argument("--device", default="cpu", help="the inner steps' device (cuda: bf16 autocast, as a GPU peer)")
    p.add_argument("--out", default="runs/parity.json")
    p.add_argument("--plot", default="")
    a = p.parse_args()
    if a.plot_from:
        curves = curves_in(a.plot_from.split(","))
        chosen = [r for r in a.plot_rows.split(",") if r] or list(curves)
        plot({r: curves[r] for r in chosen if r in curves}, Path(a.plot or "runs/parity.png"), a.title)
        return
    torch.set_num_threads(a.threads)
    base = Setup(data=tuple(x for x in a.data.split(",") if x), model=a.model, batch_size=a.batch_size,
                 seq_len=a.seq_len, inner_lr=a.inner_lr, grad_clip=a.grad_clip, beta1=a.beta1, beta2=a.beta2,
                 lr_schedule=a.lr_schedule,
                 min_lr_ratio=a.min_lr_ratio, outer_lr=a.outer_lr, outer_momentum=a.outer_momentum,
                 learners=a.learners, steps=a.steps, eval_every=a.eval_every, eval_batches=a.eval_batches,
                 device=a.device)
    rows, seeds = a.rows.split(","), [int(s) for s in a.seeds.split(",")]
    for row in rows:
        parse_row(row)  # every name checked before hours of training
    curves: dict[str, dict[int, Curve]] = {row: {} for row in rows}
    started = time.monotonic()
    for seed in seeds:
        bench = Bench.load(dataclasses.replace(base, seed=seed))
        for row in rows:
            t = time.monotonic()
            curves[row][seed] = run_row(row, bench, a.count)
            print(f"seed {seed} {row}: {curves[row][seed].final:.4f} bpb at {curves[row][seed].tokens[-1]:,} tokens "
                  f"({time.monotonic() - t:.0f} s)", flush=True)
            done = {r: c for r, c in curves.items() if c}
            result = dict(settings=dict(dataclasses.asdict(base), seeds=seeds, threads=a.threads,
                                        model_parameters=bench.n_params(),
                                        data_description=bench.data.description),
                          seconds=round(time.monotonic() - started), rows=summarize(done))
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1))
    for row, entry in result["rows"].items():
        versus = f"  vs dp {entry['vs_dp_pct_mean']:+.2f} % {entry['vs_dp_pct']}" if "vs_dp_pct" in entry else ""
        print(f"{row:>18}: {entry['final_bpb_mean']:.4f} ± {entry['spread'] / 2:.4f} bpb{versus}")
    if a.plot:
        plot(curves, Path(a.plot), f"{a.model} ({result['settings']['model_parameters'] / 1e6:.1f}M), M={a.learners}, "
                                   f"batch {a.batch_size}×{a.seq_len} per learner, {len(seeds)} seed(s)")


if __name__ == "__main__":
    main()
