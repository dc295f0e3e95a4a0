"""A network testbed: N peers in their own network namespaces, joined through a hub by links with a rate, a one-way
delay and loss (p2pdiloco.ops.testbed). Needs root. Everything it creates is removed on exit, by name.

    python scripts/ops/testbed.py --peers 4 --rate-mbit 100 --delay-ms 50 [--loss 0.001]      # up until Ctrl-C
    python scripts/ops/testbed.py --peers 4 --rate-mbit 100 --delay-ms 50 -- CMD {i} {addr}    # CMD in each peer's ns
    python scripts/ops/testbed.py --peers 3 --natted 2                  # peer 2 behind a NAT that lets nothing in

In CMD, {i} is the peer's index and {addr} its address; every command runs at once, and the testbed comes down
when all have exited.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from p2pdiloco.ops.testbed import Link, Testbed, TestbedError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one way")
    parser.add_argument("--loss", type=float, default=0.0, help="share of packets dropped, 0..1")
    parser.add_argument("--natted", default="", help="comma-separated peer indices behind a NAT (nothing inbound)")
    parser.add_argument("--prefix", default="p2pdt")
    parser.add_argument("command", nargs="*")
    a = parser.parse_args()
    try:
        natted = frozenset(int(i) for i in a.natted.split(",") if i.strip())
        with Testbed(a.peers, Link(a.rate_mbit, a.delay_ms, a.loss), prefix=a.prefix, natted=natted) as tb:
            print(f"testbed up: {a.peers} peers, {a.rate_mbit} Mbit/s, {a.delay_ms} ms one way, loss {a.loss} "
                  f"({'netem' if tb.use_netem else 'userspace delay line'})")
            for i in range(a.peers):
                behind = f" (behind a NAT: others see {tb.address(i)})" if i in natted else ""
                print(f"  peer {i}: ip netns exec {tb.ns(i)} ...   address {tb.host_address(i)}{behind}")
            if not a.command:
                try:
                    signal.sigwait({signal.SIGINT, signal.SIGTERM})
                except KeyboardInterrupt:
                    pass
                return 0
            procs = [subprocess.Popen([*tb.exec_prefix(i), *(arg.format(i=i, addr=tb.host_address(i)) for arg in a.command)])
                     for i in range(a.peers)]
            return max(p.wait() for p in procs)
    except TestbedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
