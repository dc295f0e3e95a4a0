"""What a peer puts on the wire and in the DHT, pinned byte for byte (tests/golden/): today's code makes exactly
these bytes from fixed inputs, and parses them back to those inputs. A change of format fails here until it is
made a new wire version (tests/golden/vectors.py says how), which peers publish and check at join."""

import dataclasses
import functools
import json

import pytest
import torch
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.core import codec
from p2pdiloco.protocol.remote import WIRE_VERSION, Expect, parse_member, parse_peer_record
from tests.golden import vectors

GOLDEN = vectors.folder(WIRE_VERSION)


@functools.cache
def made() -> dict[str, bytes]:
    """Made at the first test, not at import: mutation testing forks its workers after collecting the tests, and
    a process forked after torch's thread pool ran can deadlock."""
    return vectors.payloads()


def test_the_golden_folder_is_this_wire_versions_and_holds_every_vector():
    assert GOLDEN.is_dir(), f"no golden vectors for wire version {WIRE_VERSION}: python -m tests.golden.vectors"
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(vectors.NAMES) == sorted(made())
    assert json.loads((GOLDEN / "tables.json").read_text())["wire_version"] == WIRE_VERSION


@pytest.mark.parametrize("name", sorted(vectors.NAMES))
def test_todays_code_makes_the_golden_bytes(name):
    golden = (GOLDEN / name).read_bytes()
    made_now = made()[name]
    if name == "tables.json":  # say which number moved
        assert json.loads(made_now) == json.loads(golden)
    first = next((i for i, (a, b) in enumerate(zip(made_now, golden)) if a != b), min(len(made_now), len(golden)))
    assert made_now == golden, (f"{name}: {len(made_now)} bytes made against {len(golden)} golden, first difference "
                                f"at byte {first}: a format change needs a new WIRE_VERSION (tests/golden/vectors.py)")


@pytest.mark.parametrize("name", ["int4-part.bin", "int4-sum.bin", "topk-part.bin", "topk-sum.bin"])
def test_the_golden_parts_and_sums_parse_back_to_their_values(name):
    dense, topk = vectors.formats()
    values, kind = vectors.parts()[name]
    fmt = topk if kind.startswith("top-k") else dense
    decode = fmt.decode_sum if kind.endswith("sum") else fmt.decode
    golden = (GOLDEN / name).read_bytes()
    for sent in (bytes([codec.RAW]) + golden, codec.compress(golden)):  # stored, or through Zstandard
        assert torch.equal(decode(sent, vectors.N).long(), values)


@pytest.mark.parametrize("name", ["int4-part.bin", "int4-sum.bin", "topk-part.bin", "topk-sum.bin"])
def test_every_byte_of_a_golden_part_counts(name):
    """A bit flipped anywhere (64 places, and the last byte, where padding lies) gives other values or a refusal,
    never the same values: the format has no bit a peer could change unseen."""
    dense, topk = vectors.formats()
    values, kind = vectors.parts()[name]
    fmt = topk if kind.startswith("top-k") else dense
    decode = fmt.decode_sum if kind.endswith("sum") else fmt.decode
    golden = bytearray((GOLDEN / name).read_bytes())
    for at in [*range(0, len(golden), max(1, len(golden) // 64)), len(golden) - 1]:
        flipped = bytearray(golden)
        flipped[at] ^= 1 << (at % 8)
        try:
            assert not torch.equal(decode(bytes([codec.RAW]) + bytes(flipped), vectors.N).long(), values), at
        except ValueError:
            pass


def test_the_golden_records_parse_to_what_was_sent():
    member, record = vectors.records()
    gathered = parse_member(MSGPackSerializer.loads((GOLDEN / "member-record.msgpack").read_bytes()),
                            Expect(vectors.N))
    assert (gathered.peer, gathered.version, gathered.tokens, gathered.steps, gathered.budget) == \
        ("12D3KooWgolden", 7, 4096, 32, 12.5)
    assert gathered.maxabs == member["maxabs"] and gathered.block_norms == member["block_norms"]
    assert gathered.blame == {"12D3KooWother"} and gathered.credential == b"p" * 32
    published = parse_peer_record(MSGPackSerializer.loads((GOLDEN / "peer-record.msgpack").read_bytes()))
    assert published == record and dataclasses.asdict(published)["wire"] == WIRE_VERSION


def test_top_k_keeps_the_ceiling_of_its_fraction_of_each_block():
    """k = ⌈fraction · block⌉, at least 1: a peer that rounds down sends parts this one cannot parse."""
    tables = json.loads((GOLDEN / "tables.json").read_text())
    assert tables["topk_k"]["0.02"][tables["topk_lengths"].index(1 << 14)] == 328  # ⌈327.68⌉
    assert tables["topk_k"]["0.001"][:3] == [1, 1, 1]
