"""One peer's codec work in one round, per compression, beside the time its bytes take on the link (issue 10).

The all-reduce can only run at its link bound when the CPU keeps up: every peer quantizes and packs its whole
pseudo-gradient, decodes, checks and sums the N senders' pieces of the part it reduces, packs that part's sum,
then decodes, checks and dequantizes every piece of the sums; and the sum audit (p2pdiloco.core.audit): a
reducer fingerprints every share of its part, a member each sum it takes and its own codes there, made again.
This runs exactly those calls
(p2pdiloco.core.codec, p2pdiloco.core.claims), piece by piece as swarm/codes.py does, on one thread (the
averager's codec worker is one thread), and prints per stage the seconds of one core, the bytes the peer sends,
and the ratio of the codec's seconds to the link bound 2·(N−1)/N·S/B of those bytes: well under 1, and the
codec can hide behind the transfer; near 1, a CPU peer's round is CPU-bound. The lossless stage is timed side by
side with the alternatives it replaced (Zstandard, `codec.compress`, against DEFLATE of runs and zlib level 1).

The pseudo-gradient is synthetic and heavy-tailed (randn · U⁴, as the codec tests use), so the compressed sizes
are indicative; the default's 20-bit codes are stored raw, whatever the data.

Usage: python scripts/bench/bench_codec.py [--params 11000000] [--peers 4] [--rate-mbit 100]
       [--compression none,int8,int4,int2] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import zlib

import torch

from p2pdiloco.core import audit, codec
from p2pdiloco.core.claims import block_norms, claims_in_codes, sum_why_not
from p2pdiloco.swarm.codes import PIECE


def one_round(deltas: list[torch.Tensor], bits: int) -> tuple[dict, int]:
    """Seconds per stage of one peer's codec work in one round, and the bytes it sends (its codes to the other
    reducers, its part's sum to the other members). `deltas[0]` is this peer's Δ, the others the other senders'
    (their codes of our part are made untimed: their own peers make them); the sums of the other parts stand in
    as ours to decode (the work is the same)."""
    delta, peers = deltas[0], len(deltas)
    n, fmt, seconds = delta.numel(), codec.DenseFormat(bits, peers), collections.Counter()
    statistics = [fmt.block_statistic(d) for d in deltas]  # the block maximum; int2's mean |value| (as the averager)
    scales = codec.agreed_scales(statistics, bits)
    no_clipping = torch.zeros(statistics[0].numel(), dtype=torch.bool)
    claims = [claims_in_codes(stat, no_clipping, block_norms(d), 1.0, scales, codec.levels(bits),
                              maxima=codec.levels(bits) > 1) for stat, d in zip(statistics, deltas)]

    def timed(stage, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        seconds[stage] += time.perf_counter() - start
        return out

    def blocks(a, b):
        return slice(a // codec.BLOCK, -(-b // codec.BLOCK))

    pieces = [(a, min(a + PIECE, n)) for a in range(0, n, PIECE)]
    part = pieces[: -(-len(pieces) // peers)]  # the pieces this peer reduces
    wire, sums, sent = [], {}, 0
    for a, b in pieces:
        codes = timed("quantize", codec.quantize, delta[a:b], scales[blocks(a, b)], bits)
        wire.append(timed("pack", fmt.encode, codes, None))
        sent += len(wire[-1]) * (peers - 1) // peers  # the pieces of the other reducers' parts
    for i, (a, b) in enumerate(part):
        received = [wire[i]] + [fmt.encode(codec.quantize(d[a:b], scales[blocks(a, b)], bits), None)
                                for d in deltas[1:]]
        total = torch.zeros(b - a, dtype=torch.int64)
        shares = []
        for sender, data in enumerate(received):
            codes = timed("unpack", fmt.decode, data, b - a)
            timed("check", claims[sender].why_not, codes, a)
            timed("sum", total.add_, codes)
            shares.append(codes)
        sums[i] = timed("pack sum", fmt.encode_sum, total)
        draws = timed("audit: account", audit.Fingerprints, audit.piece_seed(b"group", a, sums[i], ()), b - a)
        for codes in shares:  # our account of the part: every sender's share, ours included
            timed("audit: account", draws.of, codes)
        sent += len(sums[i]) * (peers - 1)  # served to every other member
    out = torch.empty(n)
    for i, (a, b) in enumerate(pieces):  # the other parts' sums stand in as ours (a short last piece: made here)
        data = sums[i % len(part)] if b - a == PIECE else fmt.encode_sum(torch.zeros(b - a, dtype=torch.int64))
        total = timed("unpack sum", fmt.decode_sum, data, b - a)
        timed("check sum", sum_why_not, total, a, claims)
        # its reducer's account is checked against these
        draws = timed("audit: sum", audit.Fingerprints, audit.piece_seed(b"group", a, data, ()), b - a)
        timed("audit: sum", draws.of, total)
        ours = timed("audit: our codes", codec.quantize, delta[a:b], scales[blocks(a, b)], bits)
        timed("audit: our codes", draws.of, ours)
        timed("dequantize", codec.dequantize, total, scales[blocks(a, b)], out[a:b])
    return dict(seconds), sent


def _deflate_runs(raw: bytes) -> bytes:
    """The lossless stage before Zstandard: DEFLATE with runs as its only matches (zlib's Z_RLE)."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, zlib.MAX_WBITS, 9, zlib.Z_RLE)
    return compressor.compress(raw) + compressor.flush()


def lossless_side_by_side(delta: torch.Tensor, bits: int) -> dict:
    """Bytes kept and MB/s of the Zstandard stage the codec uses against the DEFLATE of runs (zlib's Z_RLE) it
    replaced and zlib's level 1, piece by piece, compressing and expanding."""
    fmt = codec.DenseFormat(bits, 1)
    raw = [codec.pack(codec.quantize(delta[a:a + PIECE], codec.agreed_scales(
        [fmt.block_statistic(delta[a:a + PIECE])], bits), bits), bits) for a in range(0, delta.numel(), PIECE)]
    size = sum(map(len, raw))
    out = {}
    for name, squeeze, unsqueeze in (
            ("zstd, tuned (used)", lambda r: codec.compress(r), lambda z, r: codec.expand(z, len(r))),
            ("deflate runs (before)", _deflate_runs, lambda z, r: zlib.decompress(z)),
            ("deflate level 1", lambda r: zlib.compress(r, 1), lambda z, r: zlib.decompress(z))):
        start = time.perf_counter()
        packed = [squeeze(r) for r in raw]
        middle = time.perf_counter()
        assert all(unsqueeze(z, r) == r for z, r in zip(packed, raw))
        end = time.perf_counter()
        out[name] = {"kept": round(sum(map(len, packed)) / size, 3), "MB/s in": round(size / (middle - start) / 1e6),
                     "MB/s out": round(size / (end - middle) / 1e6)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=11_000_000, help="elements of the pseudo-gradient")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--compression", default="none,int8,int4,int2")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the averager's codec worker is one thread
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(args.params, generator=g) * torch.rand(args.params, generator=g) ** 4 * 1e-3
              for _ in range(args.peers)]  # every sender's own: their sums are what a reducer really packs
    delta = deltas[0]
    results = {}
    print(f"{args.params / 1e6:.1f} M elements, {args.peers} peers, {args.rate_mbit:g} Mbit/s, one core")
    for name in args.compression.split(","):
        bits = codec.BITS[name]
        seconds, sent = one_round(deltas, bits)
        link = sent / (args.rate_mbit * 1e6 / 8)
        total = sum(seconds.values())
        stages = "  ".join(f"{k} {v:.3f}" for k, v in seconds.items())
        audited = sum(v for k, v in seconds.items() if k.startswith("audit"))
        print(f"{name:5s} codec {total:.2f} s/round  sent {sent / 1e6:.1f} MB  link bound {link:.2f} s  "
              f"codec/link {total / link:.2f}  (the sum audit: {audited:.2f} s, {audited / total:.0%} of the codec's; "
              f"without it codec/link {(total - audited) / link:.2f})\n      {stages}")
        results[name] = {"codec_s": round(total, 3), "stages_s": {k: round(v, 3) for k, v in seconds.items()},
                         "sent_bytes": sent, "link_bound_s": round(link, 3), "codec_over_link": round(total / link, 3),
                         "audit_s": round(audited, 3), "codec_over_link_without_audit": round((total - audited) / link, 3)}
        if bits <= codec.COMPRESS_MAX_WIDTH:
            results[name]["lossless"] = lossless_side_by_side(delta[: 16 * PIECE], bits)
            print("      lossless stage:", results[name]["lossless"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": args.params, "peers": args.peers, "rate_mbit": args.rate_mbit,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
