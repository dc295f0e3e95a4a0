"""Tokens per second and memory of one member as it gets more local ranks (torchrun; DDP replicas, or the model
sharded with --fsdp, per --layouts): a lone member trains for --seconds with 1, 2, ... ranks in turn (each rank
--threads torch threads, so each rank has its own cores where the machine has them; --threads-alone for the member
of one process). The member's tokens per second come from its summary record; its memory is sampled
every second: the whole process tree's resident pages, each counted once (`ops.residency.union_bytes`), and each
rank's PSS (with its helpers for rank 0), peaks over the run. Run it inside a loopback-only namespace:
    unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench/bench_ranks.py --ranks 1,2'
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from p2pdiloco.ops.launcher import peer_command, start_process, stop_tree
from p2pdiloco.ops.residency import pss_bytes, union_bytes
from p2pdiloco.runtime.lifeline import descendants
from p2pdiloco.runtime.schema import Start, Summary, of_kind, read_records


def run(ranks: int, layout: str, a, folder: Path) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    join = peer_command("join", "--model", a.model, "--name", "m", "--log-dir", str(folder), "--checkpoint-dir",
                        str(folder / "ck"), "--max-time", str(a.seconds), "--eval-every", "0", "--checkpoint-every",
                        "0", "--threads", str(alone_threads(a) if ranks == 1 else a.threads),
                        *(["--fsdp"] if layout == "fsdp" else []), *a.join)
    if ranks > 1:
        join = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                *join[1:]]
    started = time.monotonic()
    proc = start_process(join, folder / "m.out")
    peaks = dict(member=0)
    try:
        while proc.poll() is None and time.monotonic() < started + a.seconds + 600:
            sample(proc.pid, peaks)
            time.sleep(1.0)
    finally:
        stop_tree(proc)
    records = read_records(folder / "m.jsonl")
    summary, start = of_kind(records, Summary)[-1], of_kind(records, Start)[-1]
    return dict(ranks=ranks, layout=layout, tokens_per_s=summary.tokens / summary.training_seconds,
                tokens=summary.tokens,
                training_seconds=summary.training_seconds, n_params=start.n_params,
                member_peak_bytes=peaks["member"], member_bytes_per_param=peaks["member"] / start.n_params,
                rank_peak_pss_bytes={r: v for r, v in peaks.items() if r != "member"}, exit=proc.returncode)


def alone_threads(a) -> int:
    """A one-process member's torch threads: --threads-alone (e.g. every core, as a peer's default), else --threads."""
    return a.threads_alone or a.threads


def sample(launcher: int, peaks: dict) -> None:
    """The member's tree, and each rank with what it started (rank 0: its DHT and averager processes)."""
    tree = [launcher, *descendants(launcher)]
    peaks["member"] = max(peaks["member"], union_bytes(tree))
    for pid in tree:
        rank = rank_of(pid)
        if rank is not None:
            total = pss_bytes(pid) + sum(pss_bytes(child) for child in descendants(pid))
            peaks[rank] = max(peaks.get(rank, 0), total)


def rank_of(pid: int):
    """The torchrun RANK of a p2pdiloco peer process (0 without torchrun); None for anything else. A peer's forked
    helpers look like it: the peak per rank keeps the largest, the peer with its helpers."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    except OSError:
        return None
    if b"p2pdiloco.cli" not in cmdline or b"torch.distributed.run" in cmdline:
        return None
    return int(environ.get(b"RANK", b"0"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--layouts", default="ddp", help="for more than one rank: ddp, fsdp or both")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--threads-alone", type=int, default=0,
                        help="torch threads of the one-process member (default: --threads)")
    parser.add_argument("--seconds", type=float, default=90.0, help="each run's --max-time")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/ranks.json"))
    parser.add_argument("join", nargs="*", help="more `p2pdiloco join` flags (after --)")
    a = parser.parse_args()
    counts = [int(n) for n in a.ranks.split(",")]
    setups = [(n, layout) for n in counts for layout in (a.layouts.split(",") if n > 1 else ["one"])]
    folder, rows = Path(tempfile.mkdtemp(prefix="ranks-")), []
    try:
        for _ in range(a.repeats):
            for n, layout in setups:
                rows.append(run(n, layout, a, folder / "run"))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    name = {setup: f"{setup[0]}-{setup[1]}" for setup in setups}
    rate = {name[s]: statistics.mean(r["tokens_per_s"] for r in rows if (r["ranks"], r["layout"]) == s)
            for s in setups}
    first = name[setups[0]]
    result = dict(model=a.model, threads_per_rank=a.threads, threads_alone=alone_threads(a), seconds=a.seconds,
                  runs=rows, tokens_per_s=rate,
                  speedup={k: rate[k] / rate[first] for k in rate})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    for setup in setups:
        last = [r for r in rows if (r["ranks"], r["layout"]) == setup][-1]
        key = name[setup]
        threads = alone_threads(a) if setup[0] == 1 else a.threads
        print(f"{a.model}, {key} × {threads} thread(s): {rate[key]:.0f} tokens/s, {rate[key] / rate[first]:.3f}× "
              f"{first}; member {last['member_peak_bytes'] / 1e9:.2f} GB ({last['member_bytes_per_param']:.1f} "
              f"B/param), per rank PSS "
              + ", ".join(f"{r}: {v / 1e9:.2f} GB" for r, v in sorted(last["rank_peak_pss_bytes"].items())))
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
