"""Bounded fuzz runs of every parser of remote bytes: random and mutated inputs raise only the parser's own
error (which the caller turns into an excluded member, a left-out part or a dropped donor), never anything else,
and never allocate beyond what the part may hold. Gathered and DHT records: tests/unit/test_remote_input.py."""

import asyncio
import random

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.core import codec
from p2pdiloco.swarm.codes import CodesError, _header, _left_out, _reply
from p2pdiloco.swarm.statefetch import parse_part_request
from p2pdiloco.swarm.transfer import TransferError, fetch_parts

ROUNDS = 400  # per parser: seconds in all, and fixed seeds, so a failure reproduces


def mutations(rng: random.Random, good: bytes):
    """Bit flips, truncations, extensions, splices and random bytes around a well-formed message."""
    data = bytearray(good)
    choice = rng.randrange(6)
    if choice == 0 and data:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif choice == 1:
        data = data[: rng.randrange(len(data) + 1)]
    elif choice == 2:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif choice == 3 and data:
        i = rng.randrange(len(data))
        data = data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(0, 16))) + data[i:]
    elif choice == 4:
        data = bytearray(bytes(rng.randrange(256) for _ in range(rng.randint(0, 200))))
    else:
        data = bytearray([rng.choice([codec.RAW, codec.ZSTD, 1, 7])]) + data[1:]
    return bytes(data)


def formats(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    for fmt, bits in ((codec.DenseFormat(4, 3), 4), (codec.DenseFormat(8, 5), 8), (codec.TopKFormat(2, 3, 0.05), 2)):
        selected = fmt.select(x)
        codes = codec.quantize(x, codec.agreed_scales([codec.block_maxabs(x)], bits), bits).to(torch.int64) * selected
        yield fmt, fmt.encode(codes, selected), fmt.encode_sum(codes * 2)


@pytest.mark.parametrize("n", [1000, 2 * codec.BLOCK + 17])
def test_codec_parts_and_sums_raise_only_value_errors(n):
    rng = random.Random(n)
    for fmt, part, total in formats(n):
        for good, decode in ((part, fmt.decode), (total, fmt.decode_sum)):
            decode(good, n)  # the unmutated message parses
            for _ in range(ROUNDS):
                try:
                    out = decode(mutations(rng, good), n)
                except ValueError:
                    continue
                assert out.shape == (n,) and out.dtype == torch.int32  # whatever parses has the part's shape


def test_expanding_never_goes_beyond_its_bound():
    rng = random.Random(1)
    bomb = codec.compress(b"\0" * (1 << 22))
    with pytest.raises(ValueError):
        codec.expand(bomb, 1 << 10)
    for _ in range(ROUNDS):
        try:
            assert len(codec.expand(mutations(rng, bomb), 1 << 12)) <= 1 << 12
        except ValueError:
            pass


def test_codes_headers_and_reducer_replies_raise_only_codes_errors():
    rng = random.Random(2)
    members = {"a", "b"}
    goods = [MSGPackSerializer.dumps(dict(group=b"g" * 16)), MSGPackSerializer.dumps(dict(dropped=["a"])),
             MSGPackSerializer.dumps(dict(error="x"))]
    for good in goods:
        for _ in range(ROUNDS):
            blob = mutations(rng, good)
            for parse in (_header, lambda b: _left_out(_reply(b).get("dropped"), members)):
                try:
                    parse(blob)
                except CodesError:
                    pass


def test_state_part_requests_raise_only_value_errors():
    rng = random.Random(3)
    good = MSGPackSerializer.dumps(dict(version=3, digest="abcdef", start=0, length=100))
    assert parse_part_request(good) == (3, "abcdef", 0, 100)
    for _ in range(ROUNDS):
        try:
            version, digest, start, length = parse_part_request(mutations(rng, good))
        except ValueError:
            continue
        assert start >= 0 and length > 0


def test_fuzzed_state_parts_never_enter_an_accepted_state():
    """A hostile donor serves mutated tensor messages; an honest one serves the rest. A part that does not parse,
    or has the wrong shape, drops its donor; one that parses but lies is caught by the whole state's digest,
    which the joiner checks before adopting anything (core.state.validate_state). Per-part digests, so that only
    the lying donor's parts are fetched again, are not there yet."""
    from hivemind.compression import deserialize_torch_tensor

    from p2pdiloco.core.exact import digest
    from p2pdiloco.core.state import validate_state

    rng = random.Random(4)
    state, momentum = torch.arange(4000, dtype=torch.float32), torch.zeros(4000)
    announced = dict(version=5, digest=digest(torch.cat([state, momentum])))
    good_proto = serialize_torch_tensor(state[:500]).SerializeToString()

    async def fetch_part(donor, start, length):
        if donor == "honest":
            return dict(version=5, digest="abcdef"), state[start:start + length].clone()
        proto = runtime_pb2.Tensor()
        proto.ParseFromString(mutations(rng, good_proto))  # may raise: a malformed stream
        return dict(version=5, digest="abcdef"), deserialize_torch_tensor(proto)

    accepted = refused = 0
    for _ in range(60):
        try:
            result = asyncio.run(fetch_parts(["hostile", "honest"], (5, "abcdef"), 4000, fetch_part, 5.0, size=500))
        except TransferError:
            continue
        why = validate_state(announced, [result.flat, momentum], 4000, 5)
        assert (why is None) == torch.equal(result.flat, state), why
        accepted += why is None
        refused += why is not None
    assert accepted and refused  # both happened: the run exercised the digest check
