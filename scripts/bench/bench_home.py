"""A swarm of home volunteers on the testbed: TRAINERS peers, each behind its own masquerading NAT that lets
nothing in, and one public node at RATE Mbit/s and DELAY ms one way, with and without `bootstrap --reduce`.

Per variant: the rounds each trainer tried and merged, compute utilization, the node's bytes on its interface
against what its groups need (each of the N senders pushes its codes of the whole model and fetches the sum: as
packed, before the lossless stage) and against what the trainers' averagers measured sending and receiving, and the peak memory of the node's averager process above its resident size
before the first round, against the bytes of one sender's codes. Needs root; run it as
    python scripts/bench/bench_home.py [--model small] [-H 20] [--rounds 6] [--variants node,none]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from p2pdiloco.core import codec
from p2pdiloco.ops.cpuload import read_procs
from p2pdiloco.ops.launcher import stop_tree
from p2pdiloco.ops.testbed import Link, Testbed
from p2pdiloco.runtime.schema import Round, Start, Summary, of_kind, read_records


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class NodeMemory:
    """Samples the node's processes: its averager is the last child forked from the node's own process."""

    def __init__(self, pid: int):
        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(0.2):
            children = sorted((p for p in read_procs() if p.ppid == self.pid and "python" in p.cmdline),
                              key=lambda p: p.started)
            averager = children[-1].pid if len(children) >= 2 else None  # the DHT's child is forked first
            self.samples.append((time.time(), rss_bytes(self.pid), rss_bytes(averager) if averager else 0))


def interface_bytes(tb: Testbed) -> int:
    out = subprocess.run([*tb.exec_prefix(0), "sh", "-c", "cat /sys/class/net/v0/statistics/rx_bytes "
                          "/sys/class/net/v0/statistics/tx_bytes"], capture_output=True, text=True, check=True)
    return sum(int(x) for x in out.stdout.split())


def run(variant: str, args) -> dict:
    log_dir = args.log_dir / variant
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.iterdir():
        old.unlink()
    trainers = range(1, args.trainers + 1)
    with Testbed(args.trainers + 1, Link(rate_mbit=args.rate_mbit, delay_ms=args.delay_ms),
                 prefix="p2pdt-homeb", natted=frozenset(trainers)) as tb:
        node = subprocess.Popen([*tb.exec_prefix(0), sys.executable, "-m", "p2pdiloco.cli", "bootstrap", "--listen",
                                 f"/ip4/{tb.host_address(0)}/tcp/0", "--log-dir", str(log_dir), "--run-id", "home",
                                 *(["--reduce"] if variant == "node" else [])],
                                stdout=open(log_dir / "node.out", "w"), stderr=subprocess.STDOUT)
        procs = [node]
        try:
            deadline = time.monotonic() + 60
            while not (log_dir / "bootstrap.addrs").exists():
                assert time.monotonic() < deadline, "the node did not start"
                time.sleep(0.3)
            address = (log_dir / "bootstrap.addrs").read_text().split()[0]
            before = interface_bytes(tb)
            with NodeMemory(node.pid) as memory:
                started = time.monotonic()
                procs += [subprocess.Popen(
                    [*tb.exec_prefix(i), sys.executable, "-m", "p2pdiloco.cli", "join", "--initial-peers", address,
                     "--client-mode", "--listen", f"/ip4/{tb.host_address(i)}/tcp/0", "--name", f"p{i}",
                     "--model", args.model, "--threads", "1", "-H", str(args.H), "--max-rounds", str(args.rounds),
                     "--compression", args.compression, "--eval-every", "0", "--checkpoint-every", "0",
                     "--bandwidth-mbps", str(args.rate_mbit), "--log-dir", str(log_dir), "--run-id", "home"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in trainers]
                codes = [p.wait(timeout=args.timeout) for p in procs[1:]]
                wall = time.monotonic() - started
            moved = interface_bytes(tb) - before
        finally:
            for p in procs:
                stop_tree(p)
    return summarize(log_dir, args, variant, codes, wall, moved, memory.samples)


def logged_at(line: str) -> float:
    """The wall-clock time of a log line ("2026-11-28 21:29:31,717 INFO ...")."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def thinned(memory: list, pushes: list) -> list:
    """The node averager's resident MB, one sample a second from its first (seconds since then), and where a state
    push began: the memory over the run, to look at."""
    samples = [(t, a) for t, _, a in memory if a]
    if not samples:
        return []
    t0, out = samples[0][0], {}
    for t, a in samples:
        out.setdefault(int(t - t0), round(a / 2 ** 20, 1))
    return [[k, v] for k, v in sorted(out.items())] + [["push", round(t - t0, 1)] for t in sorted(pushes)]


def pushed_from(line: str) -> float:
    """When a state push began: its log line is written at its end and says how long it took ("... in 78.0 s"),
    and the node holds the state from the push's first part."""
    return logged_at(line) - float(line.rsplit(" in ", 1)[1].split(" s", 1)[0])


def summarize(log_dir: Path, args, variant: str, codes: list, wall: float, moved: int, memory: list) -> dict:
    names = [f"p{i}" for i in range(1, args.trainers + 1)]
    rounds = {name: of_kind(read_records(log_dir / f"{name}.jsonl"), Round) for name in names}
    summaries = [s for name in names for s in of_kind(read_records(log_dir / f"{name}.jsonl"), Summary)]
    merged = {name: [r for r in rs if r.applied and len(r.members) > 1] for name, rs in rounds.items()}
    n = next((s.n_params for s in of_kind(read_records(log_dir / "p1.jsonl"), Start) if s.n_params), 0)
    bits = codec.BITS[args.compression]
    # what the node reduced: one line per group, naming its members; as the only reducer of a group of N it takes
    # N senders' codes of the whole model and serves the sum N times
    groups = [line.split("reduced a part for ", 1)[1].split(" in ")[0].count(",") + 1
              for line in (log_dir / "node.out").read_text().splitlines() if "reduced a part for" in line]
    needed = sum(k * (codec.packed_bytes(n, bits) + codec.packed_bytes(n, codec.sum_width(bits, k))) for k in groups)
    # the state relayed for peers in need: each push comes in, and goes out again to the peer that fetches it
    pushes = [pushed_from(line) for name in names for line in (log_dir / f"{name}.log").read_text().splitlines()
              if "pushed our state" in line]
    relayed = 2 * len(pushes) * 2 * n * 4
    # what the rounds moved, as every trainer measured it at its averager: the node is the only public member,
    # so each of those bytes went to it or came from it
    trainers_moved = sum((r.bytes_sent or 0) + (r.bytes_received or 0) for rs in rounds.values() for r in rs)
    before_relay = [a for t, _, a in memory if a and (not pushes or t < min(pushes))]
    baseline = next((a for _, _, a in memory if a), 0)
    peak = max((a for _, _, a in memory), default=0)
    return dict(variant=variant, exit_codes=codes, wall_seconds=round(wall, 1), n_params=n,
                rounds_tried={k: len(v) for k, v in rounds.items()}, rounds_merged={k: len(v) for k, v in merged.items()},
                merged_share=sum(map(len, merged.values())) / max(1, sum(map(len, rounds.values()))),
                not_merged={k: [r.reason for r in v if not (r.applied and len(r.members) > 1)] for k, v in rounds.items()},
                global_versions=len({r.version for rs in merged.values() for r in rs}), node_groups=groups,
                utilization=statistics.mean(s.utilization for s in summaries) if summaries else None,
                node_bytes=moved, node_bytes_needed_by_its_groups=needed, trainers_round_bytes=trainers_moved,
                node_over_trainers=moved / trainers_moved if trainers_moved else None, state_pushes=len(pushes),
                state_relay_bytes=relayed,
                node_over_needed=(moved - relayed) / needed if needed else None,
                node_over_needed_with_relay=moved / needed if needed else None,
                node_averager_rss_before=baseline, node_averager_rss_peak=peak,
                node_averager_extra=peak - baseline if baseline else None,
                node_averager_extra_before_relay=(max(before_relay) - baseline) if before_relay and baseline else None,
                one_senders_codes=codec.packed_bytes(n, bits) if n else None,
                node_averager_rss_mb_each_second=thinned(memory, pushes))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="node,none")
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--model", default="small")
    parser.add_argument("-H", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--compression", default="int4")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--log-dir", type=Path, default=Path("runs/home"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    for variant in args.variants.split(","):
        if variant not in ("node", "none"):
            parser.error(f"unknown variant {variant!r}: node or none")
        results.append(run(variant, args))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(settings=vars(args) | dict(log_dir=str(args.log_dir), out=str(args.out)),
                                            results=results), indent=1))


if __name__ == "__main__":
    main()
