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
    """What parses is what the stream code relies on: a request header is a dict naming a group of at most 64
    bytes, and a reducer's left-out senders are members of the group; anything else is a CodesError."""
    rng = random.Random(2)
    members = {"a", "b"}
    header = MSGPackSerializer.dumps(dict(group=b"g" * 16))
    assert _header(header)["group"] == b"g" * 16
    assert _left_out(_reply(MSGPackSerializer.dumps(dict(dropped=["a"]))).get("dropped"), members) == {"a"}
    for bad in (MSGPackSerializer.dumps(dict(group=b"g" * 65)), MSGPackSerializer.dumps(dict(group="g")),
                MSGPackSerializer.dumps([b"g"]), b""):
        with pytest.raises(CodesError):
            _header(bad)
    with pytest.raises(CodesError):
        _left_out(["a", "stranger"], members)
    goods = [header, MSGPackSerializer.dumps(dict(dropped=["a"])), MSGPackSerializer.dumps(dict(error="x"))]
    parsed = refused = 0
    for good in goods:
        for _ in range(ROUNDS):
            blob = mutations(rng, good)
            try:
                group = _header(blob)["group"]
                assert isinstance(group, bytes) and len(group) <= 64
                parsed += 1
            except CodesError:
                refused += 1
            try:
                assert _left_out(_reply(blob).get("dropped"), members) <= members
            except CodesError:
                pass
    assert parsed and refused  # both happened: the run exercised the checks


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


def _served_state(**change):
    from p2pdiloco.core.exact import digest

    params, momentum = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    tensors = change.pop("tensors", [params, momentum])
    if change.pop("nan", False):
        tensors = [params.clone(), momentum]
        tensors[0][7] = float("nan")
    meta = dict(version=5, digest=digest(*tensors) if all(isinstance(t, torch.Tensor) for t in tensors) else "x")
    return {**meta, **change}, tensors


@pytest.mark.parametrize("change, why", [
    (dict(), None),
    (dict(version="5"), "integer version"), (dict(version=4), "older than ours"),
    (dict(tensors=[torch.zeros(64)]), "parameters and momentum"),
    (dict(tensors=[torch.zeros(64, dtype=torch.float64), torch.zeros(64)]), "do not match this model"),
    (dict(tensors=[torch.zeros(63), torch.zeros(63)]), "do not match this model"),
    (dict(tensors=[torch.zeros(64), "x"]), "do not match this model"),
    (dict(nan=True), "NaN or infinity"),  # served with its true digest: only the finiteness check refuses it
    (dict(digest="0" * 16), "announced digest"),
], ids=["honest", "version-type", "older", "one-tensor", "float64", "shape", "not-a-tensor", "nan", "digest"])
def test_a_downloaded_state_is_refused_for_each_reason_with_it(change, why):
    from p2pdiloco.core.state import validate_state

    meta, tensors = _served_state(**change)
    said = validate_state(meta, tensors, 64, 5)
    assert said is None if why is None else why in said, said
    assert validate_state([meta], tensors, 64, 5) == "metadata is not a dict with an integer version"
