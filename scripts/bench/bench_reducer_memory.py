"""What summing a part costs a reducer in resident memory, in one process with no network: N senders' int4 codes
of an n-element part, piece by piece as a reducer node sums them (`Reduction`), each sum dropped once made.

    python scripts/bench/bench_reducer_memory.py --elements 262144    # then 20000000, in a process of its own

A part of one piece shows the first round's working set (code and thread pools a first sum brings in); a larger
part shows what grows with the part. Run each size in a fresh process: the working set is paid once per process.
docs/internet.md quotes it."""

import argparse
import asyncio
import os
import threading
import time

import torch

from p2pdiloco.core import codec
from p2pdiloco.swarm.codes import Codes, Reduction, piece_ranges


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """The process's resident size, sampled every 5 ms in a thread."""

    def __init__(self):
        self.base, self.peak, self._stop = resident(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, resident())
            time.sleep(0.005)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return (self.peak - self.base) / 2 ** 20


async def reduce(n: int, senders: int) -> None:
    fmt = codec.DenseFormat(4, senders + 1)
    pieces = piece_ranges(0, n)
    g = torch.Generator().manual_seed(0)
    payloads = {}  # one random piece per length, reused: the senders' codes are not what is measured
    r = Reduction(group=b"g")
    names = [f"s{i}" for i in range(senders)]
    r.begin(names, Codes(n, lambda a, b: (torch.zeros(b - a, dtype=torch.int8), None)), fmt)
    for index, (a, b) in enumerate(pieces):
        if b - a not in payloads:
            payloads[b - a] = fmt.encode(torch.randint(-7, 8, (b - a,), generator=g), None)
        for name in names:
            r.add(name, index, payloads[b - a], len(pieces))
        await r.settle(index)
        r.pieces[index].result = None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, nargs="+", default=[262144])
    parser.add_argument("--senders", type=int, default=3)
    args = parser.parse_args()
    for n in args.elements:
        peak = Peak()
        asyncio.run(reduce(n, args.senders))
        print(f"{n} elements ({len(piece_ranges(0, n))} pieces), {args.senders} senders: resident peak "
              f"+{peak.stop():.1f} MB")


if __name__ == "__main__":
    main()
