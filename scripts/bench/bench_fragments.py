"""Streaming fragments on slow links, side by side: N peers on the network testbed (each in its own namespace,
links of RATE Mbit/s with DELAY ms one way), the same model, H, wire and rounds, with --fragments 1 and P.

Per variant: each peer's send rate as its link carries it (the hub's counter of the bytes the peer's link
delivered, sampled every 50 ms), its peak over any 1 s window, compute utilization and the final validation loss
(each peer's summary), the other peers' all-reduce and round times (with `--slow-peer`, the last peer's link
is that slow: what the others wait for it), wall-clock. Prints the peaks' ratio against --fragments 1 (issue 50's
goal: at most 1/6 at P = 8) and writes the JSON and a PNG of the traces. Needs root (the testbed); run it as
    python scripts/bench/bench_fragments.py [--fragments 1,8] [--model small] [-H 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from bench_bandwidth import first_address, stopped_at_exit
from p2pdiloco.config import InnerConfig
from p2pdiloco.ops.testbed import Link, Testbed
from p2pdiloco.runtime.schema import Round, Summary, of_kind, read_records

SAMPLE_SECONDS = 0.05
# runs in the hub's namespace: each peer's link, as the hub receives from it (what the peer sent, after its tbf)
SAMPLER = """
import sys, time
devs = sys.argv[1].split(",")
while True:
    values = [open(f"/sys/class/net/{d}/statistics/rx_bytes").read().strip() for d in devs]
    print(time.time(), *values, flush=True)
    time.sleep(float(sys.argv[2]))
"""


def run_variant(tb: Testbed, fragments: int, cap: Optional[float], args, log_dir: Path) -> dict:
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    common = ["--model", args.model, "--threads", "1", "-H", str(args.H), "--max-rounds", str(args.rounds),
              "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--compression", args.compression,
              "--fragments", str(fragments), "--eval-every", "0", "--checkpoint-every", "0", "--log-dir",
              str(log_dir), "--run-id", f"frag{fragments}", "--bandwidth-mbps", str(args.rate_mbit),
              "--quorum", str(args.peers), *(["--upload-mbps", str(cap)] if cap else [])]
    devs = ",".join(f"h{i}" for i in range(args.peers))
    procs, started = [], time.monotonic()
    with stopped_at_exit(procs), (log_dir / "rates.txt").open("w") as rates:
        sampler = subprocess.Popen(["ip", "netns", "exec", tb.hub, sys.executable, "-c", SAMPLER, devs,
                                    str(SAMPLE_SECONDS)], stdout=rates)
        procs.append(sampler)
        peers = []
        for i in range(args.peers):
            join = ["--initial-peers", first_address(log_dir, timeout=120)] if i else []
            cmd = [*tb.exec_prefix(i), sys.executable, "-m", "p2pdiloco.cli", "join", "--listen",
                   f"/ip4/{tb.address(i)}/tcp/0", "--name", f"p{i}", *join, *common]
            with (log_dir / f"p{i}.out").open("wb") as out:
                peers.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        procs.extend(peers)
        for p in peers:
            p.wait(timeout=args.timeout)
    wall = time.monotonic() - started
    samples = [[float(x) for x in line.split()] for line in (log_dir / "rates.txt").read_text().splitlines()
               if len(line.split()) == args.peers + 1]
    summaries = [s for i in range(args.peers) for s in of_kind(read_records(log_dir / f"p{i}.jsonl"), Summary)]
    rounds = [r for i in range(args.peers) for r in of_kind(read_records(log_dir / f"p{i}.jsonl"), Round)]
    peaks = [peak_rate(samples, i + 1, 1.0) for i in range(args.peers)]
    fast = [r for i in range(args.peers - 1 if args.slow_peer else args.peers)
            for r in of_kind(read_records(log_dir / f"p{i}.jsonl"), Round) if r.applied and len(r.members) > 1]
    result = dict(fragments=fragments, upload_mbps=cap, exit_codes=[p.returncode for p in peers],
                  wall_seconds=round(wall, 1),
                  peak_bytes_per_s=peaks, peak_mean=statistics.mean(peaks),
                  mean_bytes_per_s=[mean_rate(samples, i + 1) for i in range(args.peers)],
                  merged_rounds=sum(r.applied for r in rounds), rounds=len(rounds),
                  island_sizes=sorted({len(r.members) for r in rounds if r.applied}),
                  # the other peers' merged rounds: the all-reduce's time (with a slow peer: its transfer), and
                  # ready → settled
                  sync_seconds=median([r.sync_seconds for r in fast]),
                  round_seconds=median([r.round_seconds for r in fast]),
                  utilization=statistics.mean(s.utilization for s in summaries) if summaries else None,
                  final_val=statistics.mean(s.final_val for s in summaries) if summaries else None,
                  trace=trace(samples, 1, 0.25))
    result["floor_bytes_per_s"] = floor_rate(result["trace"])
    result["record_stores"], result["record_fetches"] = zip(*(heartbeat_counts(log_dir / f"p{i}.log")
                                                              for i in range(args.peers)))
    return result


HEARTBEAT_LINE = re.compile(r"heartbeat: (\d+) stores of our record, (\d+) fetches of every copy")


def heartbeat_counts(log: Path) -> tuple[Optional[int], Optional[int]]:
    """How often a peer stored its record and fetched every copy of the records over its run, as it logged them
    when it left (swarm.records.Heartbeat.stop); None where it did not."""
    found = HEARTBEAT_LINE.findall(log.read_text(errors="replace")) if log.exists() else []
    return (int(found[-1][0]), int(found[-1][1])) if found else (None, None)


def variant(spec: str) -> tuple[int, Optional[float]]:
    fragments, _, cap = spec.partition("@")
    return int(fragments), float(cap) if cap else None


def median(values: list):
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def peak_rate(samples: list, column: int, window: float) -> float:
    """The most bytes a column's counter grew by in any `window` seconds, per second."""
    best, start = 0.0, 0
    for end in range(len(samples)):
        while samples[end][0] - samples[start][0] > window:
            start += 1
        if samples[end][0] - samples[start][0] >= window * 0.9:
            best = max(best, (samples[end][column] - samples[start][column]) / (samples[end][0] - samples[start][0]))
    return best


def floor_rate(binned: list[tuple[float, float]]) -> float:
    """Peer 0's median send rate over 0.25 s bins: between bursts, what its control traffic (records, matchmaking)
    keeps the link at."""
    return statistics.median(rate for _, rate in binned) if binned else 0.0


def mean_rate(samples: list, column: int) -> float:
    return (samples[-1][column] - samples[0][column]) / max(samples[-1][0] - samples[0][0], 1e-9)


def trace(samples: list, column: int, bin_seconds: float) -> list[tuple[float, float]]:
    """(seconds since the first sample, bytes per second over the bin) for one peer."""
    out, t0, last = [], samples[0][0], samples[0]
    for s in samples[1:]:
        if s[0] - last[0] >= bin_seconds:
            out.append((round(s[0] - t0, 2), (s[column] - last[column]) / (s[0] - last[0])))
            last = s
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), sharey=True)
    for ax, (name, r) in zip(list(axes) if len(results) > 1 else [axes], results.items()):
        xs, ys = zip(*r["trace"]) if r["trace"] else ([], [])
        ax.plot(xs, [y * 8 / 1e6 for y in ys], lw=0.8)
        cap = f" --upload-mbps {r['upload_mbps']:g}" if r.get("upload_mbps") else ""
        ax.set_title(f"--fragments {r['fragments']}{cap}: peer 0's send rate (0.25 s bins); peak over 1 s "
                     f"{r['peak_bytes_per_s'][0] * 8 / 1e6:.1f} Mbit/s", fontsize=9)
        ax.set_ylabel("Mbit/s")
        ax.grid(alpha=0.3)
    axes_list = list(axes) if len(results) > 1 else [axes]
    axes_list[-1].set_xlabel("seconds")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fragments", default="1,8", help="the variants, run in this order: P, or P@CAP for a peer's "
                   "--upload-mbps CAP (e.g. 1,8@1.5); the peaks' ratios are against the uncapped P = 1")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--model", default="small")
    p.add_argument("-H", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="rounds of each fragment (--max-rounds)")
    # a peer's own batch by default: utilization is the share of its time between steps, and a fragment's round
    # costs the training thread a fixed few ms (its outer step, digest and rebase), so a smaller batch than the
    # peers' lowers it (4 x 128, this bench's default until 2026-12-01: 0.986-0.987 at P = 8, docs/fragments.md)
    p.add_argument("--batch-size", type=int, default=InnerConfig().batch_size)
    p.add_argument("--seq-len", type=int, default=InnerConfig().seq_len)
    p.add_argument("--compression", default="int4")
    p.add_argument("--slow-peer", type=float, default=0.0,
                   help="the last peer's link in Mbit/s (a slow uplink among the others; 0: all alike)")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--log-dir", type=Path, default=Path("runs/bench-fragments"))
    p.add_argument("--out", type=Path, default=Path("runs/bench-fragments/report.json"))
    p.add_argument("--plot", type=Path, default=Path("runs/bench-fragments/peak.png"))
    args = p.parse_args()
    variants = [variant(x) for x in args.fragments.split(",")]
    results = {}
    rates = {args.peers - 1: args.slow_peer} if args.slow_peer else {}
    with Testbed(args.peers, Link(args.rate_mbit, args.delay_ms), rates=rates) as tb:
        for fragments, cap in variants:
            name = f"P{fragments}" + (f"cap{cap:g}" if cap else "")
            results[name] = r = run_variant(tb, fragments, cap, args, args.log_dir / name)
            print(f"{name}: peak {r['peak_mean'] * 8 / 1e6:.2f} Mbit/s (mean of the peers' 1 s "
                  f"peaks; peer 0's median over 0.25 s bins {r['floor_bytes_per_s'] * 8 / 1e6:.2f}), "
                  f"utilization {r['utilization']}, final val {r['final_val']}, {r['merged_rounds']} merged "
                  f"rounds, islands {r['island_sizes']}, the others' all-reduce {r['sync_seconds']} s and round "
                  f"{r['round_seconds']} s (medians), {r['wall_seconds']} s, exit {r['exit_codes']}; stores of each "
                  f"peer's record {list(r['record_stores'])}, fetches of every copy {list(r['record_fetches'])}",
                  flush=True)
    base = results.get("P1")
    for name, r in results.items():
        if base is not None and r is not base:
            r["peak_over_p1"] = r["peak_mean"] / base["peak_mean"]
            print(f"{name}: peak {r['peak_over_p1']:.3f} of --fragments 1's (goal: at most 1/6 = 0.167 at P = 8)")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(settings=settings, results=results), indent=1))
    plot(results, args.plot, f"{args.peers} peers, {args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms, {args.model}, "
         f"H {args.H}, {args.compression}, {args.rounds} rounds of each fragment"
         + (f", the last peer at {args.slow_peer:g} Mbit/s" if args.slow_peer else ""))


if __name__ == "__main__":
    main()
