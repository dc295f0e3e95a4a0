"""How fast a joiner fetches the global state from one donor over a slow, long link: the real part server and
fetcher (p2pdiloco.swarm.statefetch) over libp2p, on the network testbed, with one part in flight against several
(`--streams`), alternated in one run, each on a warm connection of its own. Needs root (the testbed).

    python scripts/bench/bench_state_transfer.py --elements 19800000 --rate-mbit 100 --delay-ms 50 --streams 1,4 --trials 3

`--elements`: Θ ⊕ momentum, in fp32 elements (the `base` model's is 2 × 9.9 M). Per variant: the seconds of each
fetch and the median's ratio to the link bound (the state's bytes at link rate); the state arrives bit for bit or
the run fails.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import torch
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.ops.testbed import NO_NAT_PROBING, Link, Testbed
from p2pdiloco.swarm.statefetch import PartServer, StateFetcher

NAMESPACE, KEY = "bench", (7, "bench-digest")


def state(elements: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    half = elements // 2
    return [torch.randn(half, generator=generator), torch.randn(elements - half, generator=generator)]


class Donor(ServicerBase):
    def __init__(self, tensors: list[torch.Tensor]):
        async def get_state():
            return MSGPackSerializer.dumps(dict(version=KEY[0], digest=KEY[1])), tensors, None
        self.parts = PartServer(get_state)

    async def rpc_state_part(self, request: averaging_pb2.DownloadData,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in self.parts.serve_part(request):
            yield message


async def donate(address: str, elements: int, out: Path) -> None:
    p2p = await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/0"], **NO_NAT_PROBING)
    await Donor(state(elements)).add_p2p_handlers(p2p, namespace=NAMESPACE)
    out.write_text(str((await p2p.get_visible_maddrs())[0]))
    await asyncio.Event().wait()


class Replica:
    """What StateFetcher asks of a DHT: a libp2p daemon, here one of our own connected to the donor."""

    def __init__(self, address: str, donor: str):
        self.address, self.donor, self.p2p = address, donor, None

    async def replicate_p2p(self) -> P2P:
        if self.p2p is None:
            self.p2p = await P2P.create(host_maddrs=[f"/ip4/{self.address}/tcp/0"], initial_peers=[self.donor],
                                        **NO_NAT_PROBING)
        return self.p2p


def join(address: str, donor: str, elements: int, variants: list[int], trials: int, idle: float) -> None:
    expected = torch.cat(state(elements))
    donor_id = donor.split("/p2p/")[1]
    fetchers = {k: StateFetcher(Replica(address, donor), lambda p2p, peer: Donor.get_stub(
        p2p, peer, namespace=NAMESPACE), part_timeout=120.0, streams_per_donor=k) for k in variants}
    for k in variants:  # each fetcher's own daemon connects and warms up: not timed
        fetchers[k].fetch([donor_id], KEY, elements, timeout=600)
    for trial in range(trials):
        for k in variants:
            time.sleep(idle)  # as between a join's DHT lookups and its download: the connection sat idle
            started = time.monotonic()
            got = fetchers[k].fetch([donor_id], KEY, elements, timeout=600)
            seconds = time.monotonic() - started
            if not torch.equal(got.flat, expected):
                raise SystemExit("the state did not arrive bit for bit")
            print(json.dumps(dict(streams=k, trial=trial, seconds=seconds)), flush=True)
    for f in fetchers.values():
        f.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=19_800_000)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one way")
    parser.add_argument("--streams", default="1,4", help="parts in flight per donor, one variant each")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds the connection sits idle before a fetch")
    parser.add_argument("--out", type=Path)
    Testbed.role_arguments(parser, "donor", "joiner")
    args = parser.parse_args()
    variants = [int(k) for k in args.streams.split(",")]
    if args.role == "donor":
        asyncio.run(donate(args.address, args.elements, args.address_file))
        return 0
    if args.role == "joiner":
        join(args.address, args.other, args.elements, variants, args.trials, args.idle)
        return 0
    return run(args, variants)


def run(args, variants: list[int]) -> int:
    me = [sys.executable, os.path.abspath(__file__), "--elements", str(args.elements)]
    with Testbed(2, Link(args.rate_mbit, args.delay_ms), prefix="p2pdt-state") as tb:
        runs = tb.serve_and_ask([*me, "--role", "donor"], [*me, "--role", "joiner", "--streams", args.streams,
                                                           "--trials", str(args.trials), "--idle", str(args.idle)])
    bound = args.elements * 4 / (args.rate_mbit * 1e6 / 8)
    report = dict(elements=args.elements, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms, idle=args.idle,
                  link_bound_seconds=bound, runs=runs, variants={})
    print(f"{args.elements * 4 / 1e6:.1f} MB over {args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms one way: "
          f"link bound {bound:.2f} s")
    for k in variants:
        seconds = [r["seconds"] for r in runs if r["streams"] == k]
        median = statistics.median(seconds)
        report["variants"][k] = dict(seconds=seconds, median=median, over_link_bound=median / bound)
        print(f"  {k} part(s) in flight: {', '.join(f'{s:.2f}' for s in seconds)} s; median {median:.2f} s = "
              f"{median / bound:.2f}× the link bound")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
