"""The golden wire vectors: what today's code puts on the wire and in the DHT, from fixed inputs (integer
arithmetic only, no random generator: the same bytes on every machine and torch). tests/unit/test_golden.py
checks the code against the files under tests/golden/v<WIRE_VERSION>/; a change of format makes a new folder:

    python -m tests.golden.vectors      (writes the folder of the current WIRE_VERSION; refuses to overwrite one)

so that a format change is a version change (p2pdiloco.protocol.remote.WIRE_VERSION). The lossless stage's
Zstandard frames are left out (their bytes follow the library's version, and any conforming frame decodes):
a part is pinned as its expanded payload, and parsed as sent raw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
N = 2 * (1 << 14) + 37  # two whole blocks and a short one
GROUP = 3  # members whose codes a sum adds


NAMES = ("int4-part.bin", "int4-sum.bin", "topk-part.bin", "topk-sum.bin", "member-record.msgpack",
         "peer-record.msgpack", "account.msgpack", "tables.json")


def folder(version: int) -> Path:
    return HERE / f"v{version}"


def signal(n: int = N) -> torch.Tensor:
    """Distinct magnitudes in every block (a permutation of 0..n−1, shifted by a quarter): top-k has no ties."""
    return ((torch.arange(n, dtype=torch.int64) * 7919) % n).double().sub(n // 2).add(0.25).float()


def codes(n: int = N, bits: int = 4) -> torch.Tensor:
    limit = (1 << (bits - 1)) - 1
    return ((torch.arange(n, dtype=torch.int64) * 31) % (2 * limit + 1)) - limit


def formats():
    from p2pdiloco.core import codec

    return codec.DenseFormat(4, GROUP), codec.TopKFormat(4, GROUP, 0.02)


def parts() -> dict[str, tuple[torch.Tensor, str]]:
    """File name → (the values it carries, what they are: a dense or top-k part or sum)."""
    dense, topk = formats()
    c = codes()
    selected = topk.select(signal())
    sparse = torch.where(c == 0, 1, c) * selected  # no selected code is 0: `selected` is where it is not
    total = torch.zeros(N, dtype=torch.int64)
    for shift in range(GROUP):  # three members' codes, each rolled: sums of many values
        total += torch.roll(c, shift * 5)
    sparse_total = sparse + torch.roll(sparse, 1)  # a union of two members' indices
    return {"int4-part.bin": (c, "dense part"), "int4-sum.bin": (total, "dense sum"),
            "topk-part.bin": (sparse, "top-k part"), "topk-sum.bin": (sparse_total, "top-k sum")}


def records() -> tuple[dict, "PeerRecord"]:
    from p2pdiloco.protocol.remote import PeerRecord
    from p2pdiloco.protocol.merge import BodyStatistics
    from p2pdiloco.swarm.averager import gather_record

    statistics = BodyStatistics.of(signal(), formats()[0])
    member = gather_record("12D3KooWgolden", "golden", 7, 4096, 32, statistics, "0123456789abcdef", 12.5,
                           blame=["12D3KooWother"], credential=b"p" * 32)
    record = PeerRecord(peer="12D3KooWgolden", name="golden", version=7, digest="0123456789abcdef", ready=7,
                        merging=-1, inner_step=320, tokens_per_s=1234.5, sketch=[0.5, -0.25], loss=3.25, rounds=6,
                        island=3, bytes_sent=1 << 20, client_mode=False, merged_by=3,
                        lanes=[dict(version=6, digest="fedcba9876543210", merged_by=2, ready=-1, merging=6,
                                    sketch=[0.125], rounds=5, island=2, bytes_sent=1 << 19)],
                        settings=dict(model="tiny", compression="int4"))
    return member, record


def account(served: bytes) -> dict:
    """A reducer's account (p2pdiloco.core.audit) of the dense sum's three shares, seeded by `served`: pins the
    seed's hash, numpy's PCG64 stream and the fingerprint's arithmetic, which every member must share with its
    reducers (one bit apart, honest reducers would be blamed)."""
    from p2pdiloco.core import audit

    seed = audit.piece_seed(b"golden group", 1 << 14, served, ("12D3KooWleft",))
    c = codes()
    shares = {audit.OWN: c, "12D3KooWa": torch.roll(c, 5), "12D3KooWb": torch.roll(c, 10)}
    return {key: audit.to_bytes(audit.fingerprint(values, seed)) for key, values in shares.items()}


def payloads() -> dict[str, bytes]:
    """File name → the bytes today's code makes for it."""
    from hivemind.utils.serializer import MSGPackSerializer

    from p2pdiloco.core import codec

    dense, topk = formats()
    made = parts()
    selected = made["topk-part.bin"][0] != 0
    expand = lambda blob: codec.expand(blob, 1 << 26)  # noqa: E731
    member, record = records()
    return {
        "int4-part.bin": expand(dense.encode(made["int4-part.bin"][0], torch.ones(N, dtype=torch.bool))),
        "int4-sum.bin": expand(dense.encode_sum(made["int4-sum.bin"][0])),
        "topk-part.bin": expand(topk.encode(made["topk-part.bin"][0], selected)),
        "topk-sum.bin": expand(topk.encode_sum(made["topk-sum.bin"][0])),
        "member-record.msgpack": MSGPackSerializer.dumps(member),
        "peer-record.msgpack": MSGPackSerializer.dumps(record.value()),
        "account.msgpack": MSGPackSerializer.dumps(account(expand(dense.encode_sum(made["int4-sum.bin"][0])))),
        "tables.json": ("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(tables().items()))
                        + "\n}\n").encode(),
    }


def tables() -> dict:
    """The numbers every peer must agree on: tags, widths, top-k's k and the sums' widths."""
    from p2pdiloco.core import codec
    from p2pdiloco.protocol.remote import WIRE_VERSION

    lengths = [1, 2, 5, 63, 64, 65, 100, 1000, 4097, 1 << 14]
    return dict(
        wire_version=WIRE_VERSION, block=codec.BLOCK, raw_tag=codec.RAW, zstd_tag=codec.ZSTD,
        index_width=codec.INDEX_WIDTH, count_width=codec.COUNT_WIDTH,
        topk_k={f"{fraction:g}": [codec.TopKFormat(4, 1, fraction).k(n) for n in lengths]
                for fraction in (0.001, 0.0156, 0.02, 0.05, 0.1, 0.5, 1.0)},
        topk_lengths=lengths,
        sum_width={str(bits): [codec.sum_width(bits, g) for g in range(1, 65)] for bits in (2, 3, 4, 5, 6, 8)},
    )


def write(version: int) -> Path:
    out = folder(version)
    if out.exists():
        raise SystemExit(f"{out} exists: a changed format takes a new WIRE_VERSION (p2pdiloco/protocol/remote.py)")
    out.mkdir()
    for name, data in payloads().items():
        (out / name).write_bytes(data)
    return out


if __name__ == "__main__":
    from p2pdiloco.protocol.remote import WIRE_VERSION

    print(write(int(sys.argv[1]) if len(sys.argv) > 1 else WIRE_VERSION))
