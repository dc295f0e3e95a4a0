"""4-peer runs of equal length, clean and with one hostile peer: the honest peers' final validation loss against the
clean runs', and how many rounds the hostile peer cost them (issue 11's closing table).

    unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench/bench_hostile.py --seeds 0,1,2'

Each run: a bootstrap node and peers a, b, c (honest) and d, all `tiny` with int4 rounds, the same H, rounds and
seed. In a clean run d is honest too; otherwise a test fault plan makes d hostile from its first round: ×100 its
Δ and 1000× its tokens (scaled-plain), noise of its Δ's spread and 1000× its tokens (random-plain), NaN in its Δ
(nan), all with no option set; and the random liar under --robust-merge (random), the option for swarms that
expect attackers. `ahead`: from v2 on, d claims versions it never made and serves a state of its own.
`flipped`, `noise`, `replay`, `tiny`: more liars whose claims are true of their lie (−Δ, noise of Δ's norm, its
first Δ replayed, Δ × 10⁻³, each with 1000× its tokens). `--variants lies` runs them with clean and claimed at the
defaults (since 2026-11-29 the robust merge and --max-influence-ratio 1), `--variants lies-before` at the defaults
before (`-before`: no robust merge, ratio 1.5), and `<lie>-robust` under the robust merge at ratio 1.5.
`claimed`: the scaled liar whose claims are measured on its lie (×100 Δ, its block maxima and norms as sent,
1000× its tokens): no claims check catches it; `clean-influence<r>` and `claimed-influence<r>` run with
--max-influence-ratio r (1.5, 1): the bound's price and its effect.
More variants (--variants): controls three (the honest peers without d), clean-robust and clean-fp32; the scaled
liar on fp32 (scaled-fp32; nan-fp32 beside it), with --robust-merge (scaled) and in client mode (scaled-client).
`--variants pairs`: 6 peers, a colluding pair d and f (one lie, one noise seed) beside a, b, c and e, and clean6.
`--variants price`: clean at the defaults and `clean-filed` at the merge settings when issue 51 was filed (no
direction check, influence bound or norm floor): the defaults' price on clean runs.
`--variants reducers`: d reduces its part bent within its senders' claims and hides it in its account
(`reducer`, `reducer-fp32`), beside clean and clean-fp32.
Saved runs (--out) can be reported together again without running anything: --load A.json B.json.
Reported per variant: the honest peers' final validation loss (the mean of a, b, c; by seed, then the mean over
seeds), its difference to the clean runs' mean, the honest rounds not merged, the rounds that merged d's
contribution, and those whose reducers left d's parts out.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional

from p2pdiloco.ops.launcher import join_command, start_bootstrap, start_process, stop_tree
from p2pdiloco.runtime.schema import Round, Start, Summary, of_kind, read_records

HONEST = ("a", "b", "c")
LIES = ("clean", "claimed", "flipped", "noise", "replay", "tiny")  # issue 51's table (--variants lies)
I15 = ("--max-influence-ratio", "1.5")
BEFORE = ("--no-robust-merge", *I15)  # the defaults until 2026-11-29
# the merge's settings when issue 51 was filed: no direction check, no influence bound, no norm floor
FILED = ("--no-robust-merge", "--max-influence-ratio", "0", "--min-norm-ratio", "0")


class Variant(NamedTuple):
    fault: Optional[str]  # peer d's fault plan ("": honest); None: d does not run
    flags: tuple = ()  # for every peer, after the common ones (int4 unless they say otherwise)
    d_flags: tuple = ()  # for d alone
    pair: bool = False  # 6 peers: honest a, b, c, e and a colluding pair d, f (the same fault plan, so the same lie)

    @property
    def honest(self) -> tuple:
        return HONEST + ("e",) if self.pair else HONEST

    @property
    def hostile(self) -> tuple:
        return () if self.fault is None else ("d", "f") if self.pair else ("d",)


VARIANTS = {
    "clean": Variant(""),
    "scaled": Variant("hostile_scaled@0", ("--robust-merge",)),
    "random": Variant("hostile_random@0", ("--robust-merge",)),
    "nan": Variant("hostile_nan@0"),
    # controls: what the honest peers reach without d at all, and clean with the robust merge
    "three": Variant(None),
    "clean-robust": Variant("", ("--robust-merge",)),
    "clean-fp32": Variant("", ("--compression", "none")),
    "clean-filed": Variant("", FILED),  # the price of issue 51's defaults on clean runs: clean against this
    # the liars without --robust-merge: int4, and the default wire format (20-bit codes)
    "scaled-plain": Variant("hostile_scaled@0", ("--no-robust-merge",)),
    "random-plain": Variant("hostile_random@0", ("--no-robust-merge",)),
    "scaled-fp32": Variant("hostile_scaled@0", ("--compression", "none")),
    "nan-fp32": Variant("hostile_nan@0", ("--compression", "none")),
    # the scaled liar in client mode: it reduces no part, so every part of its Δ goes through an honest reducer
    "scaled-client": Variant("hostile_scaled@0", ("--robust-merge",), ("--client-mode",)),
    # the influence bound (weight × Δ norm at most r × the island's median): its price on clean runs, and the
    # scaled liar under it
    # `claimed`: the scaled liar whose claims are measured on its lie (no claims check can catch it)
    "claimed": Variant("hostile_claimed@0"),
    "clean-influence1.5": Variant("", ("--max-influence-ratio", "1.5")),
    "claimed-influence1.5": Variant("hostile_claimed@0", ("--max-influence-ratio", "1.5")),
    "clean-influence1": Variant("", ("--max-influence-ratio", "1")),
    "claimed-influence1": Variant("hostile_claimed@0", ("--max-influence-ratio", "1")),
    # from v2 on, d holds, publishes and serves a state of its own 5 versions ahead (p2pdiloco.core.reach)
    "ahead": Variant("hostile_ahead@2"),
    # more liars whose claims are true of their lie (p2pdiloco.faults.lies), each with 1000× its tokens: −Δ, noise
    # of Δ's norm, its first round's Δ replayed, Δ × 10⁻³: at the defaults (the robust merge and an influence
    # ratio of 1 since 2026-11-29), at the defaults before (`-before`), and under --robust-merge alone (`-robust`)
    **{lie: Variant(f"hostile_{lie}@0") for lie in ("flipped", "noise", "replay", "tiny")},
    **{f"{lie}-before": Variant(f"hostile_{lie}@0" if lie != "clean" else "", BEFORE) for lie in LIES},
    **{f"{lie}-robust": Variant(f"hostile_{lie}@0" if lie != "clean" else "", ("--robust-merge", *I15))
       for lie in LIES},
    # colluding pairs, 2 of 6 peers (issue 51's goal: within 3 % of the clean 6-peer runs). Both liars draw their
    # noise from one seed, so `noise-pair` sends one direction twice: each liar finds the other in the sum it is
    # held against, which is what the direction check must withstand
    "clean6": Variant("", pair=True),
    **{f"{lie}-pair": Variant(f"hostile_{lie}@0", pair=True) for lie in ("claimed", "flipped", "noise")},
    # d reduces its part bent within the claims (the others' codes flipped) and hides it in its account's own
    # share (p2pdiloco.faults.reducer): on int4 and on the 20-bit codes
    "reducer": Variant("hostile_reducer@0"),
    "reducer-fp32": Variant("hostile_reducer@0", ("--compression", "none")),
}
DEFAULT_VARIANTS = ("clean", "scaled-plain", "random-plain", "nan", "random")


def run_once(variant: str, seed: int, args, root: Path) -> dict:
    v = VARIANTS[variant]
    fault, extra, d_extra = v.fault, v.flags, v.d_flags
    log_dir = root / f"{variant}-{seed}"
    run_id = f"h{variant}{seed}".replace(".", "p")  # a run id has no '.' (it prefixes hivemind's keys)
    common = ["--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--threads", "1", "-H", str(args.inner_steps),
              "--max-rounds", str(args.rounds), "--compression", "int4", "--quorum", "2", "--eval-every", "0",
              "--checkpoint-every", "0", "--seed", str(seed), *extra]
    procs = {}
    try:
        procs["bootstrap"], address = start_bootstrap(log_dir, ["--run-id", run_id])
        for name in v.honest + v.hostile:
            env = {"P2PDILOCO_FAULT_PLAN": fault} if name in v.hostile and fault else None
            own = d_extra if name in v.hostile else ()
            procs[name] = start_process(join_command(address, name, log_dir, *common, *own,
                                                     run_id=run_id),
                                        log_dir / f"{name}.log", env=env)
        deadline = time.monotonic() + args.timeout
        for name in v.honest:
            left = max(1.0, deadline - time.monotonic())
            if procs[name].wait(left) != 0:
                raise RuntimeError(f"{variant} seed {seed}: peer {name} failed; see {log_dir / (name + '.log')}")
    finally:
        for proc in procs.values():
            stop_tree(proc)
    return measure(log_dir, v.honest, v.hostile or ("d",))


def measure(log_dir: Path, honest: tuple = HONEST, hostile: tuple = ("d",)) -> dict:
    """A round merged a hostile peer's contribution when it is among its members and no reducer left its parts out
    (`excluded` names it by peer id then); with a pair, a round that merged either."""
    ids = {name: of_kind(read_records(log_dir / f"{name}.jsonl"), Start)[0].peer_id for name in hostile
           if (log_dir / f"{name}.jsonl").exists()}
    finals, lost, merged_d, left_out_d = [], 0, set(), set()
    for name in honest:
        records = read_records(log_dir / f"{name}.jsonl")
        finals.append(of_kind(records, Summary)[-1].final_val)
        rounds = of_kind(records, Round)
        lost += sum(not r.applied for r in rounds)
        merged_d |= {r.version for r in rounds for h, peer in ids.items()
                     if r.applied and h in r.members and peer not in r.excluded}
        left_out_d |= {r.version for r in rounds for peer in ids.values() if r.applied and peer in r.excluded}
    return dict(val=statistics.fmean(finals), honest_not_merged=lost / len(honest), rounds_merging_d=len(merged_d),
                rounds_leaving_d_out=len(left_out_d))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    parser.add_argument("--load", type=Path, nargs="+", default=None,
                        help="report these saved --out files (later files win per variant and seed) instead of running")
    args = parser.parse_args()
    if args.load:
        results = {}
        for path in args.load:
            saved = json.loads(path.read_text())
            args.rounds, args.inner_steps = saved["rounds"], saved["inner_steps"]
            for variant, runs in saved["runs"].items():
                results.setdefault(variant, {}).update({int(seed): r for seed, r in runs.items()})
        report(results, args)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the run's peers (finally) when stopped
    seeds = [int(s) for s in args.seeds.split(",")]
    named = {"lies": list(LIES), "lies-before": [f"{v}-before" for v in LIES],
             "pairs": ["clean6", "claimed-pair", "flipped-pair", "noise-pair"],
             "reducers": ["clean", "reducer", "clean-fp32", "reducer-fp32"],
             "price": ["clean", "clean-filed"]}
    variants = named.get(args.variants) or args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        for seed in seeds:  # seeds outermost: a variant's runs spread over the session, like the clean ones
            for variant in variants:
                results.setdefault(variant, {})[seed] = run_once(variant, seed, args, Path(tmp))
                print(f"{variant:7s} seed {seed}: {results[variant][seed]}", flush=True)
    report(results, args)
    if args.out:
        args.out.write_text(json.dumps(dict(rounds=args.rounds, inner_steps=args.inner_steps, runs=results), indent=1))
    return 0


def report(results: dict, args) -> None:
    clean = statistics.fmean(r["val"] for r in results["clean"].values()) if "clean" in results else None
    print(f"\n{args.rounds} rounds of H = {args.inner_steps}, 4 peers (d hostile unless clean; 6 with d and f "
          "hostile in the pairs), tiny, int4 unless the variant says\n")
    print("| variant | honest val loss by seed | mean | vs clean mean | honest rounds not merged (mean of a, b, c) "
          "| rounds that merged d's contribution | rounds that left d's parts out |")
    print("|---|---|---|---|---|---|---|")
    for variant, runs in results.items():
        vals = [r["val"] for r in runs.values()]
        mean = statistics.fmean(vals)
        versus = "" if clean is None else f"{100 * (mean / clean - 1):+.2f} %"
        spread = f" (spread {100 * (max(vals) - min(vals)) / mean:.1f} %)" if len(vals) > 1 else ""
        print(f"| {variant} | {', '.join(f'{v:.4f}' for v in vals)} | {mean:.4f}{spread} | {versus} | "
              f"{', '.join(format(r['honest_not_merged'], 'g') for r in runs.values())} | "
              f"{', '.join(str(r['rounds_merging_d']) for r in runs.values())} | "
              f"{', '.join(str(r['rounds_leaving_d_out']) for r in runs.values())} |")

    paired(results)


def paired(results: dict) -> None:
    """Each variant against each reference, seed by seed (same seed, same data order): the mean relative
    difference and its standard error. Runs of one seed still differ by timing, so this is what a difference must
    exceed to mean something."""
    references = [r for r in ("clean", "clean-before", "clean-filed", "clean-robust", "clean-fp32", "three", "clean6") if r in results]
    print("\n| variant | " + " | ".join(f"vs {r}, paired by seed" for r in references) + " |")
    print("|---|" + "---|" * len(references))
    for variant, runs in results.items():
        cells = []
        for ref in references:
            seeds = sorted(set(runs) & set(results[ref]))
            diffs = [100 * (runs[s]["val"] / results[ref][s]["val"] - 1) for s in seeds]
            cells.append("–" if variant == ref or len(diffs) < 2 else
                         f"{statistics.fmean(diffs):+.2f} % ± {statistics.stdev(diffs) / len(diffs) ** 0.5:.2f}")
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
