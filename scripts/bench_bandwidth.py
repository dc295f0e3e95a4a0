"""p2pdiloco over slow links, side by side per codec: N peers on the network testbed (each in its own namespace,
links of RATE Mbit/s with DELAY ms one way), the same model, data, H and rounds for every variant.

Per variant: bytes sent per peer per round (measured at the averager process) and per token, the all-reduce time
against the link bound (bytes a peer sends / link rate), compute utilization, wall-clock, and the final validation
loss of the global model. Needs root (the testbed); run it as
    python scripts/bench_bandwidth.py --variants none,int8,int4 [-H 50] [--rounds 4] [--rate-mbit 100] [--delay-ms 50]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from p2pdiloco.ops.testbed import Link, Testbed


def run_variant(tb: Testbed, variant: str, args, log_dir: Path) -> dict:
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    codec_flags = (["--compression", "int2", "--topk", variant[4:] or "0.0156"] if variant.startswith("topk")
                   else ["--compression", variant])  # topk0.02: (e) top-k of 2 % with 2-bit codes
    common = ["--model", args.model, "--threads", "1", "-H", str(args.H), "--max-rounds", str(args.rounds),
              *codec_flags, "--eval-every", "0", "--checkpoint-every", "0", "--log-dir", str(log_dir),
              "--run-id", f"bw-{variant.replace('.', '')}", "--seed", str(args.seed), "--bandwidth-mbps", str(args.rate_mbit)]
    procs, started = [], time.monotonic()
    for i in range(args.peers):
        join = ["--initial-peers", first_address(log_dir, timeout=60)] if i else []
        cmd = [*tb.exec_prefix(i), sys.executable, "-m", "p2pdiloco.cli", "join", "--listen",
               f"/ip4/{tb.address(i)}/tcp/0", "--name", f"p{i}", *join, *common]
        with (log_dir / f"p{i}.out").open("wb") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
    for p in procs:
        p.wait(timeout=args.timeout)
    wall = time.monotonic() - started
    return summarize(log_dir, args, wall, [p.returncode for p in procs])


def run_dp(tb: Testbed, args, log_dir: Path) -> dict:
    """(a): gloo all-reduce of gradients every step, over the same links (scripts/dp_baseline.py)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).with_name("dp_baseline.py"))
    procs = [subprocess.Popen([*tb.exec_prefix(i), sys.executable, script, "--rank", str(i), "--world",
                               str(args.peers), "--master", tb.address(0), "--iface", f"v{i}", "--model", args.model,
                               "--steps", str(args.dp_steps)], stdout=subprocess.PIPE, text=True)
             for i in range(args.peers)]
    ranks = [json.loads(p.communicate(timeout=args.timeout)[0].strip().splitlines()[-1]) for p in procs]
    (log_dir / "ranks.json").write_text(json.dumps(ranks, indent=1))
    both = statistics.mean(r["tx_bytes_per_step"] + r["rx_bytes_per_step"] for r in ranks)
    return dict(exit_codes=[p.returncode for p in procs], step_seconds=statistics.mean(r["step_seconds"] for r in ranks),
                bytes_per_step_both_ways=both, bytes_per_token=both / ranks[0]["tokens_per_step"],
                utilization=None, final_val=None)


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


def summarize(log_dir: Path, args, wall: float, codes: list) -> dict:
    rounds, summaries = [], []
    for path in sorted(log_dir.glob("p*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rounds += [r for r in records if r.get("kind") == "round" and r["applied"] and len(r["members"]) > 1]
        summaries += [r for r in records if r.get("kind") == "summary"]
    sent = [r["bytes_sent"] for r in rounds if r.get("bytes_sent")]
    received = [r["bytes_received"] for r in rounds if r.get("bytes_received")]
    link = args.rate_mbit * 1e6 / 8
    bound = [r["sync_seconds"] / (max(r["bytes_sent"], r["bytes_received"]) / link) for r in rounds
             if r.get("bytes_sent") and r.get("sync_seconds")]
    tokens = [r["tokens"] for r in rounds]
    per_round = statistics.median([s + r for s, r in zip(sent, received)]) if sent else float("nan")
    return dict(exit_codes=codes, merged_rounds=len(rounds), wall_seconds=wall,
                bytes_per_round_sent=statistics.median(sent) if sent else None,
                bytes_per_round_both_ways=per_round,
                bytes_per_token=per_round / statistics.median(tokens) if tokens else None,
                sync_seconds=statistics.median([r["sync_seconds"] for r in rounds]) if rounds else None,
                allreduce_over_link_bound=statistics.median(bound) if bound else None,
                utilization=statistics.mean(s["utilization"] for s in summaries) if summaries else None,
                final_val=statistics.mean(s["final_val"] for s in summaries) if summaries else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="dp,none,int8,int4")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("-H", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--dp-steps", type=int, default=20, help="measured steps of the data-parallel baseline")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/bandwidth"))
    args = parser.parse_args()
    results = {}
    with Testbed(args.peers, Link(args.rate_mbit, args.delay_ms)) as tb:
        for variant in args.variants.split(","):
            run = run_dp if variant == "dp" else run_variant
            results[variant] = run(tb, args, args.log_dir / variant) if variant == "dp" else \
                run(tb, variant, args, args.log_dir / variant)
            print(variant, json.dumps(results[variant]), flush=True)
    (args.log_dir / "report.json").write_text(json.dumps(results, indent=1))
    keys = ["step_seconds", "bytes_per_step_both_ways", "merged_rounds", "bytes_per_round_sent", "bytes_per_round_both_ways", "bytes_per_token", "sync_seconds",
            "allreduce_over_link_bound", "utilization", "wall_seconds", "final_val"]
    print(f"\n{args.peers} peers, {args.rate_mbit} Mbit/s, {args.delay_ms} ms one way, H={args.H}, "
          f"{args.rounds} rounds, model {args.model}")
    print(f"{'':<28}" + "".join(f"{v:>14}" for v in results))
    for key in keys:
        print(f"{key:<28}" + "".join(f"{_fmt(r.get(key)):>14}" for r in results.values()))
    dp = results.get("dp", {}).get("bytes_per_token")
    if dp:  # the goal is stated against (a): bytes per token of data parallelism, both ways
        print(f"{'bytes per token vs dp':<28}" + "".join(
            f"{_fmt(r['bytes_per_token'] / dp) if r.get('bytes_per_token') else '-':>14}" for r in results.values()))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
