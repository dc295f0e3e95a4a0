"""A userspace delay line for kernels without `netem`: reads IP packets from a TUN device, holds each for a fixed
delay, optionally drops a seeded random share, and writes it back. The testbed routes every packet that crosses
its hub through the TUN device once (policy routing by input interface), so this adds one-way delay and loss.

    python -m p2pdiloco.ops.delayline --dev tbdelay --delay-ms 50 --loss 0.01 --seed 0

Runs until SIGTERM; prints one line of counters when it stops.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import signal
import struct
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU_READ = 65535


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class DelayLine:
    def __init__(self, fd: int, delay: float, loss: float, seed: int):
        self.fd, self.delay, self.loss = fd, delay, loss
        self.rng = random.Random(seed)
        self.queue: collections.deque = collections.deque()  # (due, packet): a fixed delay keeps FIFO order
        self.counts = dict(received=0, dropped=0, sent=0)
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            timeout = max(0.0, self.queue[0][0] - time.monotonic()) if self.queue else 0.5
            readable, _, _ = select.select([self.fd], [], [], timeout)
            if readable:
                self._read_all()
            self._send_due()

    def _read_all(self) -> None:
        while True:
            try:
                packet = os.read(self.fd, MTU_READ)
            except BlockingIOError:
                return
            self.counts["received"] += 1
            if self.loss and self.rng.random() < self.loss:
                self.counts["dropped"] += 1
                continue
            self.queue.append((time.monotonic() + self.delay, packet))

    def _send_due(self) -> None:
        now = time.monotonic()
        while self.queue and self.queue[0][0] <= now:
            _, packet = self.queue.popleft()
            try:
                os.write(self.fd, packet)
                self.counts["sent"] += 1
            except (BlockingIOError, OSError):
                self.counts["dropped"] += 1  # the device queue is full: as a congested link would


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dev", required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0, help="share of packets dropped, 0..1")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    line = DelayLine(open_tun(a.dev), a.delay_ms / 1000.0, a.loss, a.seed)

    def stop(*_):
        line.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    line.run()
    print(" ".join(f"{k}={v}" for k, v in line.counts.items()), flush=True)


if __name__ == "__main__":
    main()
