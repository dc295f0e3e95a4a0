"""p2pdiloco over slow links, side by side per codec: N peers on the network testbed (each in its own namespace,
links of RATE Mbit/s with DELAY ms one way), the same model, data, H and rounds for every variant.

Per variant: bytes sent per peer per round (measured at the averager process) and per token, the all-reduce time
against the link bound 2·(N−1)/N·S/B, compute utilization, wall-clock, and the validation loss of the global model
after every merged round (mean of the seeds, with their spread). Every seed runs every variant with the same peer
identities, hence the same data order: variants differ only in their codec. Needs root (the testbed); run it as
    python scripts/bench/bench_bandwidth.py --variants dp,none,int8,int4,topk0.02 [-H 500] [--rounds 3] [--seeds 0,1,2]
(a variant may name its outer learning rate: none-lr0.35 is fp32 rounds with --outer-lr 0.35)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from p2pdiloco.ops.cpuload import CpuSampler, Proc
from p2pdiloco.ops.launcher import stop_tree
from p2pdiloco.ops.testbed import Link, Testbed
from p2pdiloco.runtime.schema import Round, Start, Summary, of_kind, read_records


SPARSELOCO = ["--outer-momentum", "0", "--outer-lr", "1", "--error-feedback-decay", "0.95"]  # SparseLoCo's outer
# step: no momentum; the decayed error feedback (β = 0.95) stands in for it


def codec_flags(variant: str) -> list[str]:
    if variant.startswith("topk"):  # topk0.02: (e) top-k of 2 % with 2-bit codes
        return ["--compression", "int2", "--topk", variant[4:] or "0.02"]
    if variant.startswith("sparseloco"):  # sparseloco0.02: (e) with SparseLoCo's outer step
        return [*codec_flags("topk" + variant[len("sparseloco"):]), *SPARSELOCO]
    return ["--compression", variant]


def variant_flags(variant: str) -> list[str]:
    """A variant's wire format, and its outer learning rate where it names one: none-lr0.35 is fp32 rounds with
    --outer-lr 0.35 (given last, so it overrides SparseLoCo's)."""
    codec, _, outer_lr = variant.partition("-lr")
    return [*codec_flags(codec), *(["--outer-lr", outer_lr] if outer_lr else [])]


def run_variant(tb: Testbed, variant: str, seed: int, args, log_dir: Path) -> dict:
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    keys = args.log_dir / "identities" / f"seed{seed}"  # shared by the variants: same peer ids, same data order
    keys.mkdir(parents=True, exist_ok=True)
    common = ["--model", args.model, "--threads", "1", "-H", str(args.H), "--max-rounds", str(args.rounds),
              "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), *variant_flags(variant),
              "--eval-every", "1" if args.curves else "0", "--checkpoint-every", "0", "--log-dir", str(log_dir),
              "--run-id", f"bw-seed{seed}", "--seed", str(seed), "--bandwidth-mbps", str(args.rate_mbit),
              "--throttle", str(args.throttle)]
    procs, started = [], time.monotonic()
    with CpuSampler(process_class) as cpu, stopped_at_exit(procs):
        for i in range(args.peers):
            join = ["--initial-peers", first_address(log_dir, timeout=60)] if i else []
            cmd = [*tb.exec_prefix(i), sys.executable, "-m", "p2pdiloco.cli", "join", "--listen",
                   f"/ip4/{tb.address(i)}/tcp/0", "--name", f"p{i}", "--identity", str(keys / f"p{i}.key"), *join,
                   *common]
            with (log_dir / f"p{i}.out").open("wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        for p in procs:
            p.wait(timeout=args.timeout)
    wall = time.monotonic() - started
    return dict(seed=seed, **summarize(log_dir, args, wall, [p.returncode for p in procs], cpu))


def process_class(proc: Proc, by_pid: dict) -> str | None:
    """Who used the CPU: the peers' training processes, their hivemind workers (DHT, averager: forked, same
    command line), the libp2p daemons, the testbed's delay line, the kernel's soft-interrupt threads."""
    if proc.comm == "p2pd":
        return "daemons"
    if "p2pdiloco.ops.delayline" in proc.cmdline:
        return "delay line"
    if proc.comm.startswith("ksoftirqd"):
        return "ksoftirqd"
    parent = by_pid.get(proc.ppid)
    if "p2pdiloco.cli join" in proc.cmdline:
        return "hivemind workers" if parent and "p2pdiloco.cli join" in parent.cmdline else "trainers"
    if parent and "p2pdiloco.cli join" in parent.cmdline and "python" in proc.cmdline:
        return "hivemind workers"  # a spawned child
    return None


def run_dp(tb: Testbed, args, log_dir: Path) -> dict:
    """(a): gloo all-reduce of gradients every step, over the same links (scripts/bench/dp_baseline.py)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).with_name("dp_baseline.py"))
    procs = []
    with stopped_at_exit(procs):
        for i in range(args.peers):
            procs.append(subprocess.Popen(
                [*tb.exec_prefix(i), sys.executable, script, "--rank", str(i), "--world", str(args.peers), "--master",
                 tb.address(0), "--iface", f"v{i}", "--model", args.model, "--steps", str(args.dp_steps),
                 "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)], stdout=subprocess.PIPE,
                text=True))
        ranks = [json.loads(p.communicate(timeout=args.timeout)[0].strip().splitlines()[-1]) for p in procs]
    (log_dir / "ranks.json").write_text(json.dumps(ranks, indent=1))
    both = statistics.mean(r["tx_bytes_per_step"] + r["rx_bytes_per_step"] for r in ranks)
    return dict(exit_codes=[p.returncode for p in procs], step_seconds=statistics.mean(r["step_seconds"] for r in ranks),
                bytes_per_step_both_ways=both, bytes_per_token=both / ranks[0]["tokens_per_step"])


@contextlib.contextmanager
def stopped_at_exit(procs: list):
    """Whatever ends the block (a Ctrl-C, a timeout, an error), no process of `procs` outlives it: the testbed
    removes its namespaces on the way out, and a peer left running there would train on, unreachable."""
    try:
        yield procs
    finally:
        for p in procs:
            stop_tree(p, grace=10)


def first_address(log_dir: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = log_dir / "p0.addrs"
        if path.exists():
            addresses = [a for a in path.read_text().split() if "10.213." in a]
            if addresses:
                return addresses[0]
        time.sleep(0.2)
    raise RuntimeError("the first peer did not publish its address")


def val_curve(log_dir: Path) -> list[tuple[int, float]]:
    """The global model's val loss per version: of the state the most peers held at that version. Peers at one
    version normally hold one state; at a run's end one may merge alone after the others left (a solo round),
    forking a state with the same version number, which is not the swarm's model (a solo merge of a sparse
    variant's full Δ at its outer lr moved val by +0.3). A tie goes to the state seen first, in the logs' name order."""
    evals = {}  # version → state digest → val losses
    for path in sorted(log_dir.glob("p*.jsonl")):
        for r in of_kind(read_records(path), (Start, Round)):
            if r.val_loss is not None:
                evals.setdefault(r.version, {}).setdefault(getattr(r, "digest", ""), []).append(r.val_loss)
    return sorted((v, statistics.mean(max(states.values(), key=len))) for v, states in evals.items())


def summarize(log_dir: Path, args, wall: float, codes: list, cpu: CpuSampler | None = None) -> dict:
    rounds, summaries = [], []  # rounds: merged ones with more than one member
    for path in sorted(log_dir.glob("p*.jsonl")):
        records = read_records(path)
        rounds += [r for r in of_kind(records, Round) if r.applied and len(r.members) > 1]
        summaries += of_kind(records, Summary)
    sent = [r.bytes_sent for r in rounds if r.bytes_sent]
    received = [r.bytes_received for r in rounds if r.bytes_received]
    tokens = [r.tokens for r in rounds]
    per_round = statistics.median([s + r for s, r in zip(sent, received)]) if sent else float("nan")
    return dict(exit_codes=codes, merged_rounds=len(rounds), wall_seconds=wall,
                bytes_per_round_sent=statistics.median(sent) if sent else None,
                bytes_per_round_both_ways=per_round,
                bytes_per_token=per_round / statistics.median(tokens) if tokens else None,
                sync_seconds=statistics.median([r.sync_seconds for r in rounds]) if rounds else None,
                codec_cpu_seconds=median_or_none([r.codec_cpu_seconds for r in rounds]),
                allreduce_over_link_bound=link_bound_ratio(full_rounds(rounds, args.peers), args),
                full_round_bytes_sent=median_or_none([r.bytes_sent for r in full_rounds(rounds, args.peers)]),
                utilization=statistics.mean(s.utilization for s in summaries) if summaries else None,
                final_val=statistics.mean(s.final_val for s in summaries) if summaries else None,
                val_curve=val_curve(log_dir), **cpu_figures(cpu, full_rounds(rounds, args.peers)))


def cpu_figures(cpu: CpuSampler | None, rounds: list) -> dict:
    """The host's CPU during the whole-swarm all-reduces (each peer's, back from when it returned by its sync
    seconds) and over the whole run: on a few cores, a transport can only be judged where CPU was left over."""
    if cpu is None:
        return {}
    windows = [(r.sync_ended - r.sync_seconds, r.sync_ended) for r in rounds if r.sync_seconds and r.sync_ended]
    return dict(cpu_in_allreduce=cpu.during(windows),
                cpu_whole_run=cpu.during([(0.0, float("inf"))]))


def full_rounds(rounds: list, peers: int) -> list:
    """Rounds of the whole swarm: the transport figures compare like with like (a 2-member island sends less and
    a peer serving a late joiner its state at the same time sends more)."""
    return [r for r in rounds if len(r.members) == peers]


def median_or_none(values: list):
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def link_bound_ratio(rounds: list, args) -> float | None:
    """A round's all-reduce time over the link bound: the larger of what this peer sent and received, at link
    rate (for a reduce-scatter + all-gather among N that is 2·(N−1)/N of the payload, each way)."""
    link = args.rate_mbit * 1e6 / 8
    ratios = [r.sync_seconds / (max(r.bytes_sent, r.bytes_received) / link) for r in rounds
              if r.bytes_sent and r.sync_seconds]
    return statistics.median(ratios) if ratios else None


def tcp_over_link_bound(tb: Testbed, sent: float, args) -> float:
    """The same bytes an all-reduce round sent per peer, as plain TCP to every other peer at once, against the
    same link bound: what these links give a transport with no protocol at all (the floor for the ratio above)."""
    seconds = tb.all_to_all_seconds(int(sent / (args.peers - 1)))
    return seconds / (sent / (args.rate_mbit * 1e6 / 8))


def combine(runs: list[dict], rounds: int) -> dict:
    """Seeds of one variant: medians of the transport figures; the validation loss of the global model at
    version `rounds` (a run whose last round rolled back stopped short of it and is left out of the loss)."""
    out = {}
    for key in ("bytes_per_round_sent", "bytes_per_round_both_ways", "bytes_per_token", "sync_seconds",
                "codec_cpu_seconds", "allreduce_over_link_bound", "full_round_bytes_sent", "utilization",
                "wall_seconds", "step_seconds", "bytes_per_step_both_ways"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    out["merged_rounds"] = sum(r.get("merged_rounds", 0) for r in runs)
    for key in ("cpu_in_allreduce", "cpu_whole_run"):  # a dict per run: the last run's, as measured
        if runs and runs[-1].get(key):
            out[key] = runs[-1][key]
    for run in runs:
        run["val_at_last_version"] = dict((v, loss) for v, loss in run.get("val_curve") or []).get(rounds)
    losses = [r["val_at_last_version"] for r in runs if r["val_at_last_version"] is not None]
    out["seeds_at_last_version"] = len(losses)
    if losses:
        out["final_val"] = statistics.mean(losses)
        out["final_val_spread"] = max(losses) - min(losses)
    out["runs"] = runs
    return out


def paired_with_fp32(results: dict) -> None:
    """Each variant's loss against fp32's on the same seed (same init, same data order): the seed-to-seed spread of
    the loss itself is far larger than the codec's effect, the paired difference is not."""
    fp32 = {r["seed"]: r["val_at_last_version"] for r in results.get("none", {}).get("runs", [])}
    for variant, result in results.items():
        diffs = [100 * (r["val_at_last_version"] / fp32[r["seed"]] - 1) for r in result.get("runs", [])
                 if r.get("val_at_last_version") is not None and fp32.get(r.get("seed")) is not None]
        if diffs and variant != "none":
            result["val_vs_fp32_pct"] = statistics.mean(diffs)
            result["val_vs_fp32_pct_range"] = [min(diffs), max(diffs)]
            result["val_vs_fp32_pairs"] = len(diffs)


def plot_curves(results: dict, path: Path, tokens_per_round: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, result in results.items():
        for i, run in enumerate(result["runs"]):
            curve = run.get("val_curve") or []
            if curve:
                ax.plot([v * tokens_per_round / 1e6 for v, _ in curve], [l for _, l in curve], marker="o", ms=3,
                        color=f"C{list(results).index(variant)}", alpha=0.8, label=variant if i == 0 else None)
    ax.set_xlabel("tokens per peer (M): global version × H × batch tokens")
    ax.set_ylabel("validation loss of the global model")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="dp,none,int8,int4,topk0.02")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("-H", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seeds", default="0", help="comma-separated; every variant runs once per seed")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--throttle", type=float, default=1.0,
                        help="peers sleep (F−1)× each step's compute: on a few cores, frees CPU for the transport")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="set in each peer's namespace before the runs (repeatable): a TCP experiment")
    parser.add_argument("--line-priority", choices=["realtime", "normal"], default="realtime",
                        help="the testbed's delay line: ahead of the peers for the CPU, or sharing it")
    parser.add_argument("--line-tick-ms", type=float, default=1.0,
                        help="the delay line wakes at most once per tick (0: for each packet)")
    parser.add_argument("--no-calibration", dest="calibrate", action="store_false",
                        help="skip timing plain TCP all-to-all with the bytes of a round")
    parser.add_argument("--no-curves", dest="curves", action="store_false", help="skip the per-round evaluation")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--dp-steps", type=int, default=20, help="measured steps of the data-parallel baseline")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/bandwidth"))
    parser.add_argument("--fresh", action="store_true", help="forget the runs already in LOG_DIR/report.json")
    parser.add_argument("--report-only", action="store_true", help="re-analyse LOG_DIR/report.json, run nothing")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.report_only:
        return report(json.loads((args.log_dir / "report.json").read_text()), args, seeds)
    saved = args.log_dir / "report.json"  # runs accumulate: a variant rerun for a seed replaces that seed's run
    results = json.loads(saved.read_text()) if saved.exists() and not args.fresh else {}
    with Testbed(args.peers, Link(args.rate_mbit, args.delay_ms), realtime_line=args.line_priority == "realtime",
                 line_tick_ms=args.line_tick_ms) as tb:
        for setting in args.sysctl:
            tb.sysctl(setting)
        for variant in args.variants.split(","):
            if variant == "dp":  # bytes per token only: it sets the scale, its loss is not compared
                runs = [run_dp(tb, args, args.log_dir / "dp")]
            else:
                kept = [r for r in results.get(variant, {}).get("runs", []) if r.get("seed") not in seeds]
                runs = kept + [run_variant(tb, variant, seed, args, args.log_dir / f"{variant}-seed{seed}")
                               for seed in seeds]
            results[variant] = combine(runs, args.rounds)
            if args.calibrate and results[variant].get("full_round_bytes_sent"):
                results[variant]["tcp_over_link_bound"] = tcp_over_link_bound(
                    tb, results[variant]["full_round_bytes_sent"], args)
            print(variant, json.dumps({k: v for k, v in results[variant].items() if k != "runs"}), flush=True)
            (args.log_dir / "report.json").write_text(json.dumps(results, indent=1))
    if tb.delayline_counts:  # its packets sent late: delay the testbed added, not the link
        print("delay line", json.dumps(tb.delayline_counts), flush=True)
        (args.log_dir / "delay_line.json").write_text(json.dumps(tb.delayline_counts))
    report(results, args, seeds)


def report(results: dict, args, seeds: list[int]) -> None:
    for variant, result in results.items():
        if variant != "dp":
            for seed, run in zip(seeds, result["runs"]):  # reports written before runs carried their seed
                run.setdefault("seed", seed)
            for run in result["runs"]:  # scored again from its logs where they are still there
                logs = args.log_dir / f"{variant}-seed{run['seed']}"
                if any(logs.glob("p*.jsonl")):
                    run["val_curve"] = val_curve(logs)
            result.update({k: v for k, v in combine(result["runs"], args.rounds).items() if k != "runs"})
    paired_with_fp32(results)
    (args.log_dir / "report.json").write_text(json.dumps(results, indent=1))
    print_table(results, args, seeds)
    if args.curves:
        plot_curves({v: r for v, r in results.items() if v != "dp"}, args.log_dir / "val_loss.png",
                    args.H * args.batch_size * args.seq_len)


def print_table(results: dict, args, seeds: list[int]) -> None:
    keys = ["step_seconds", "bytes_per_step_both_ways", "merged_rounds", "bytes_per_round_sent",
            "bytes_per_round_both_ways", "bytes_per_token", "sync_seconds", "codec_cpu_seconds",
            "allreduce_over_link_bound", "tcp_over_link_bound",
            "utilization", "wall_seconds", "seeds_at_last_version", "final_val", "final_val_spread",
            "val_vs_fp32_pct", "val_vs_fp32_pct_range"]
    print(f"\n{args.peers} peers, {args.rate_mbit} Mbit/s, {args.delay_ms} ms one way, H={args.H}, "
          f"{args.rounds} rounds, batch {args.batch_size}x{args.seq_len}, model {args.model}")
    print(f"{'':<28}" + "".join(f"{v:>14}" for v in results))
    print(f"{'seeds':<28}" + "".join(f"{','.join(str(r.get('seed', '-')) for r in v.get('runs', [])) or '-':>14}"
                                     for k, v in results.items()))
    for key in keys:
        print(f"{key:<28}" + "".join(f"{_fmt(r.get(key)):>14}" for r in results.values()))
    dp = results.get("dp", {}).get("bytes_per_token")
    if dp:  # the goal is stated against (a): bytes per token of data parallelism, both ways
        print(f"{'dp / bytes per token':<28}" + "".join(
            f"{_fmt(dp / r['bytes_per_token']) if r.get('bytes_per_token') else '-':>14}" for r in results.values()))


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return f"{v:.4g}" if isinstance(v, float) else str(v) if v is not None else "-"


if __name__ == "__main__":
    main()
