"""A userspace delay line for kernels without `netem`: reads IP packets from a TUN device, holds each for a fixed
delay, optionally drops a seeded random share, and writes it back. The testbed routes every packet that crosses
its hub through the TUN device once (policy routing by input interface), so this adds one-way delay and loss.

    python -m p2pdiloco.ops.delayline --dev tbdelay --delay-ms 50 --loss 0.01 --seed 0 --queues 2

Per packet, Python costs little; the kernel's forwarding of each written packet (routing, tbf, the veth and
the receiver's TCP) runs inside the write. With one queue and 1500-byte packets that capped 4 peers at 100 Mbit/s
well below their links (plain TCP all-to-all at 2.8-3.0x the link bound at 50 ms of delay and 1.6-2.1x at 2 ms,
against 1.2-1.5x with no delay line, and 12 % of packets dropped at the TUN's queue). So, measured there:
- without loss, the device takes TSO packets (virtio-net headers): a read carries up to 64 KiB of one flow,
  held and written back whole, and the kernel cuts it into segments later, as a NIC would;
- the device has several queues, one process each (a flow hashes to one queue, so its order is kept), so the
  kernel's work runs on several cores (threads, sharing the GIL, did worse at 1 ms: 1.15-1.35x against 1.11-1.20x).
With loss, packets stay single segments, so a drop takes one segment as a lossy link would, not a burst of 40.

Under load it must still send on time: with 4 peers on `large` keeping 2 cores busy, a line at normal priority
sent 16-52 % of its packets over 5 ms late (up to 460 ms). So it runs real-time (SCHED_FIFO). Woken for every
packet, it could preempt a peer for each of over 2,000 packets a second (not counted), and it slowed their
all-reduces by a third; woken at most once per `--tick-ms` (the testbed gives 1 ms), 99 % went out within 5 ms of
due and the peers ran as fast as at normal priority. It counts how late it sent (`late_over_1ms`, `late_over_5ms`, `late_max_ms`).

Runs until SIGTERM; prints one line of counters when it stops.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import struct
import time

TUNSETIFF, TUNSETOFFLOAD = 0x400454CA, 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_MULTI_QUEUE, IFF_VNET_HDR = 0x0001, 0x1000, 0x0100, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
READ_SIZE = 1 << 17  # a TSO packet (up to 64 KiB) and its virtio-net header


def open_tun(name: str, offload: bool) -> int:
    """One queue of the multi-queue TUN device `name` (the first call creates it)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    flags = IFF_TUN | IFF_NO_PI | IFF_MULTI_QUEUE | (IFF_VNET_HDR if offload else 0)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
    if offload:  # packets keep their virtio-net header, read and written back unchanged
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


class DelayLine:
    """One queue: its own fd, FIFO and counters (a fixed delay keeps FIFO order)."""

    def __init__(self, fd: int, delay: float, loss: float, seed: int):
        self.fd, self.delay, self.loss = fd, delay, loss
        self.rng = random.Random(seed)
        self.queue: collections.deque = collections.deque()  # (due, packet)
        self.counts = dict(received=0, dropped=0, sent=0, late_over_1ms=0, late_over_5ms=0, late_max_ms=0.0)
        self.stopping = False

    def run(self, tick: float = 0.0) -> None:
        """Event-driven (tick 0): wakes for each packet that arrives or falls due. With a tick, wakes at most once
        per tick and handles all that came or fell due meanwhile: packets up to a tick late, for far fewer
        wake-ups (each of which, real-time, preempts a peer under test)."""
        while not self.stopping:
            timeout = max(0.0, self.queue[0][0] - time.monotonic()) if self.queue else 0.5
            if tick and self.queue:
                timeout = max(timeout, tick)  # each turn lasts a tick at least while packets are held
            started = time.monotonic()
            readable, _, _ = select.select([self.fd], [], [], timeout)
            if readable:
                if tick:
                    time.sleep(max(0.0, started + tick - time.monotonic()))
                self._read_all()
            self._send_due()

    def _read_all(self) -> None:
        while True:
            try:
                packet = os.read(self.fd, READ_SIZE)
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
            due, packet = self.queue.popleft()
            try:
                os.write(self.fd, packet)
                self.counts["sent"] += 1
            except (BlockingIOError, OSError):
                self.counts["dropped"] += 1  # the device queue is full: as a congested link would
            self._count_late(time.monotonic() - due)

    def _count_late(self, late: float) -> None:
        """How far past its due time a packet went out: delay the line added beyond the link's, e.g. while the
        host's cores were busy elsewhere (a testbed figure, not the network's)."""
        self.counts["late_over_1ms"] += late > 0.001
        self.counts["late_over_5ms"] += late > 0.005
        self.counts["late_max_ms"] = max(self.counts["late_max_ms"], round(late * 1000, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dev", required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0, help="share of packets dropped, 0..1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queues", type=int, default=2, help="TUN queues, a process each")
    parser.add_argument("--tick-ms", type=float, default=0.0,
                        help="wake at most once per tick (0: for every packet that arrives or falls due)")
    parser.add_argument("--normal-priority", dest="realtime", action="store_false",
                        help="run as an ordinary process (by default: real-time, ahead of the peers it carries)")
    a = parser.parse_args()
    realtime = a.realtime and run_in_real_time()  # before forking: the queues' processes inherit it
    fds = [open_tun(a.dev, offload=a.loss == 0) for _ in range(max(1, a.queues))]  # all queues before "ready"
    reports, workers = [], []
    for q in range(1, len(fds)):
        report_r, report_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _worker(DelayLine(fds[q], a.delay_ms / 1000.0, a.loss, a.seed + q), report_w, a.tick_ms / 1000.0)
        os.close(report_w)
        reports.append(report_r)
        workers.append(pid)
    line = DelayLine(fds[0], a.delay_ms / 1000.0, a.loss, a.seed)

    def stop(*_):
        line.stopping = True
        for pid in workers:
            os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    line.run(a.tick_ms / 1000.0)
    totals = dict(line.counts)
    for report, pid in zip(reports, workers):
        with os.fdopen(report) as r:
            counts = json.loads(r.read() or "{}")
        os.waitpid(pid, 0)
        for k, v in counts.items():
            totals[k] = max(totals[k], v) if k.endswith("_max_ms") else totals[k] + v
    totals["realtime"] = int(realtime)
    print(" ".join(f"{k}={v}" for k, v in totals.items()), flush=True)


def run_in_real_time() -> bool:
    """SCHED_FIFO: a packet due goes out when due, not when the cores are free of the peers under test. Sharing
    cores with 4 peers at normal priority, half the packets of a 50 ms run went out over 5 ms late (up to 360 ms):
    delay added by the testbed, not the link. The line sleeps between its turns, so it takes only what it forwards
    (the kernel also caps real-time tasks at 95 % of a second); run it with a tick (see `DelayLine.run`), or it
    preempts the peers for every packet. False where not allowed (no CAP_SYS_NICE)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return True
    except (OSError, AttributeError):
        return False


def _worker(line: DelayLine, report_w: int, tick: float) -> None:
    """A forked queue: runs until SIGTERM (or its parent's death), then reports its counters and exits."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: never outlive the line

    def stop(*_):
        line.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its workers
    try:
        line.run(tick)
        os.write(report_w, json.dumps(line.counts).encode())
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
