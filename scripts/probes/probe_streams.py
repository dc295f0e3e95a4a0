"""What libp2p streams carry over a slow, long link: SIZE bytes from one testbed peer to the other through hivemind's
daemon, over 1..K streams at once, one way or both ways at once, on one warm connection; beside it, plain TCP to
and fro over fresh connections (p2pdiloco.ops.flows). Needs root (the testbed).

    python scripts/probes/probe_streams.py --size 15e6 --streams 1,4,8 --trials 3 --rate-mbit 100 --delay-ms 50

Each stream's flow-control window caps what it carries per round trip; streams at once add their windows up.
`--transport quic` has the daemons listen on QUIC instead of TCP; `--pace-mbit R` holds each side's sending to R.
The first trial of a variant opens its streams on a connection that sat idle: reported apart from the warm ones.
"""

import argparse
import asyncio
import json
import os
import statistics
import struct
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from p2pdiloco.ops.testbed import NO_NAT_PROBING, Link, Testbed

CHUNK = 1 << 16


async def sink(_info, reader, writer) -> None:
    """Takes the bytes announced, then says how many came; again for each message until the caller closes (closing
    first, the daemon would reset the stream under our answer: p2pdiloco.swarm.codes)."""
    while True:
        try:
            size, got = struct.unpack("<Q", await reader.readexactly(8))[0], 0
        except asyncio.IncompleteReadError:
            break
        while got < size and (data := await reader.read(min(1 << 20, size - got))):
            got += len(data)
        writer.write(struct.pack("<Q", got))
        await writer.drain()
    writer.close()


async def closed_by_caller(reader, writer) -> None:
    """Close once the caller has our answer and closed its side: the daemon resets a stream closed while the
    other side still reads, and the reset loses what it has not read (as in p2pdiloco.swarm.codes)."""
    try:
        await asyncio.wait_for(reader.read(), 10.0)
    except asyncio.TimeoutError:
        pass
    writer.close()


class Pacer:
    """Holds what this process sends, all streams together, to RATE bits per second (0: unpaced): kept under the
    link's rate, the bottleneck's queue stays empty and the other direction's acknowledgements are not held in it."""

    def __init__(self, rate_bits: float = 0.0):
        self.rate, self.due = rate_bits, 0.0

    async def wait(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.due = max(self.due, now) + nbytes * 8 / self.rate
        if self.due - now > 0.002:
            await asyncio.sleep(self.due - now)


PACER = Pacer()


KEPT: dict = {}  # (peer, index) → a stream kept open for the next message, with `--reuse-streams`
REUSE = False


async def push(p2p: P2P, peer: PeerID, size: int, index: int = 0) -> None:
    key = (str(peer), index)
    reader, writer = KEPT.pop(key) if key in KEPT else (await p2p.call_binary_stream_handler(peer, "sink"))[1:]
    writer.write(struct.pack("<Q", size))
    block = b"x" * CHUNK
    for start in range(0, size, CHUNK):
        await PACER.wait(min(CHUNK, size - start))
        writer.write(block[: min(CHUNK, size - start)])
        await writer.drain()
    got = struct.unpack("<Q", await reader.readexactly(8))[0]
    if REUSE:
        KEPT[key] = reader, writer
    else:
        writer.close()
    if got != size:
        raise RuntimeError(f"{got} of {size} bytes arrived")


async def spread(p2p: P2P, peer: PeerID, size: int, streams: int) -> None:
    await asyncio.gather(*(push(p2p, peer, size // streams, i) for i in range(streams)))


LISTEN = {"tcp": "/ip4/{}/tcp/0", "quic": "/ip4/{}/udp/0/quic-v1"}


async def start(address: str, initial: list, transport: str) -> P2P:
    p2p = await P2P.create(host_maddrs=[LISTEN[transport].format(address)], initial_peers=initial,
                           **NO_NAT_PROBING)
    await p2p.add_binary_stream_handler("sink", sink)

    async def back(info, reader, writer):  # the other side asks for SIZE over K streams back to it
        size, streams = struct.unpack("<QQ", await reader.readexactly(16))
        await spread(p2p, info.peer_id, size, streams)
        writer.write(b"k")
        await writer.drain()
        await closed_by_caller(reader, writer)
    await p2p.add_binary_stream_handler("back", back)
    return p2p


async def receiver(address: str, out: Path, transport: str) -> None:
    p2p = await start(address, [], transport)
    out.write_text(str((await p2p.get_visible_maddrs())[0]))
    await asyncio.Event().wait()


async def sender(address: str, other: str, size: int, variants: list, trials: int, idle: float,
                 transport: str) -> None:
    p2p = await start(address, [other], transport)
    peer = PeerID.from_base58(other.split("/p2p/")[1])

    async def both_ways(streams: int) -> None:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, "back")
        writer.write(struct.pack("<QQ", size, streams))
        await writer.drain()
        await asyncio.gather(spread(p2p, peer, size, streams), reader.readexactly(1))
        writer.close()

    for streams, two_way in variants:
        for trial in range(trials):
            await asyncio.sleep(idle)
            started = time.monotonic()
            await (both_ways(streams) if two_way else spread(p2p, peer, size, streams))
            seconds = time.monotonic() - started
            print(json.dumps(dict(streams=streams, both_ways=two_way, trial=trial, seconds=seconds,
                                  mbit=size * 8 / seconds / 1e6)), flush=True)
    await p2p.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=15e6, help="bytes each way")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--trials", type=int, default=3, help="per variant; the first one is reported apart")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one way")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds between trials")
    parser.add_argument("--transport", choices=sorted(LISTEN), default="tcp", help="what the daemons listen on")
    parser.add_argument("--pace-mbit", type=float, default=0.0, help="each side's sending, all streams together")
    parser.add_argument("--reuse-streams", action="store_true",
                        help="keep each stream open for the next trial (their flow-control windows grown)")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="set in each peer's namespace before the trials (repeatable)")
    parser.add_argument("--out", type=Path)
    Testbed.role_arguments(parser, "receiver", "sender")
    args = parser.parse_args()
    PACER.rate = args.pace_mbit * 1e6
    global REUSE
    REUSE = args.reuse_streams
    size = int(args.size)
    variants = [(int(k), two_way) for two_way in (False, True) for k in args.streams.split(",")]
    if args.role == "receiver":
        asyncio.run(receiver(args.address, args.address_file, args.transport))
    elif args.role == "sender":
        asyncio.run(sender(args.address, args.other, size, variants, args.trials, args.idle, args.transport))
    else:
        return run(args, size)
    return 0


def run(args, size: int) -> int:
    me = [sys.executable, os.path.abspath(__file__)]
    with Testbed(2, Link(args.rate_mbit, args.delay_ms), prefix="p2pdt-probe") as tb:
        for setting in args.sysctl:
            tb.sysctl(setting)
        tcp = tb.all_to_all_seconds(size)
        duplex = tb.duplex_seconds(size, args.trials)
        transport = ["--transport", args.transport, "--pace-mbit", str(args.pace_mbit),
                     *(["--reuse-streams"] if args.reuse_streams else [])]
        runs = tb.serve_and_ask([*me, "--role", "receiver", *transport], [*me, "--role", "sender", *transport,
                                                                         "--size", str(size),
                                                             "--streams", args.streams, "--trials", str(args.trials),
                                                             "--idle", str(args.idle)])
    print(f"{size / 1e6:.1f} MB each way, {args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms one way; plain TCP both "
          f"ways at once over fresh connections: {size * 8 / tcp / 1e6:.1f} Mbit/s")
    duplex_mbit = [size * 8 / seconds / 1e6 for seconds in duplex]
    print(f"  plain TCP both ways on one connection kept open: first {duplex_mbit[0]:.1f} Mbit/s, then "
          f"{', '.join(f'{m:.1f}' for m in duplex_mbit[1:])}")
    summary = []
    for streams, two_way in dict.fromkeys((r["streams"], r["both_ways"]) for r in runs):
        mine = [r["mbit"] for r in runs if (r["streams"], r["both_ways"]) == (streams, two_way)]
        warm = statistics.median(mine[1:]) if len(mine) > 1 else None
        summary.append(dict(streams=streams, both_ways=two_way, first_mbit=mine[0], warm_median_mbit=warm))
        print(f"  {streams:2d} stream(s), {'both ways' if two_way else 'one way  '}: first {mine[0]:.1f} Mbit/s, "
              f"then {', '.join(f'{m:.1f}' for m in mine[1:])}")
    if args.out:
        args.out.write_text(json.dumps(dict(size=size, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms,
                                            transport=args.transport, pace_mbit=args.pace_mbit,
                                            reuse_streams=args.reuse_streams, sysctl=args.sysctl,
                                            tcp_both_ways_mbit=size * 8 / tcp / 1e6,
                                            tcp_one_connection_both_ways_mbit=duplex_mbit, summary=summary, runs=runs),
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
