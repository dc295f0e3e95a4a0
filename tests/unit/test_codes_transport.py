"""The reducer side of compressed rounds, without a network: it sums only complete, in-range contributions."""

import asyncio

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2

from p2pdiloco.core import codec
from p2pdiloco.swarm.codes import CodesError, CodesExchange, Reduction, part_ranges, serializer


def test_parts_cover_every_element_once():
    for n, members in ((10, 3), (7, 7), (100_003, 16)):
        ranges = part_ranges(n, members)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def reduction(own, payloads, bits=4):
    r = Reduction()
    r.spec = (sorted(payloads), own.numel(), bits, len(payloads) + 1)
    r.own = own
    r.payloads.update(payloads)
    r.settle_if_complete()
    return r


def test_a_complete_reduction_is_the_exact_sum_packed_at_its_width():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(-7, 8, (1001,), generator=g) for _ in range(4)]
    r = reduction(parts[0], {f"p{i}": codec.pack(parts[i], 4) for i in range(1, 4)})
    assert r.ready.is_set() and not r.error
    assert torch.equal(codec.unpack(r.result, codec.sum_width(4, 4), 1001), sum(parts))


def test_a_reduction_waits_for_every_member_and_never_serves_a_partial_sum():
    own = torch.zeros(10, dtype=torch.int64)
    r = Reduction()
    r.spec, r.own = (["p1", "p2"], 10, 4, 3), own
    r.payloads["p1"] = codec.pack(own, 4)
    r.settle_if_complete()
    assert not r.ready.is_set() and r.result is None  # p2's part is still missing
    r.payloads["p2"] = codec.pack(own + 1, 4)
    r.settle_if_complete()
    assert r.ready.is_set() and torch.equal(codec.unpack(r.result, codec.sum_width(4, 3), 10), own + 1)


@pytest.mark.parametrize("payload, why", [
    (codec.pack(torch.full((10,), -8), 4), "beyond ±7"),  # fits 4 bits, but is not a valid int4 code
    (b"\x00" * 3, "malformed part"),  # wrong length
])
def test_a_contribution_out_of_range_or_of_the_wrong_size_fails_the_part(payload, why):
    r = reduction(torch.zeros(10, dtype=torch.int64), {"evil": payload})
    assert r.ready.is_set() and why in r.error and r.result is None


def test_pushes_are_bounded_and_checked_before_they_are_kept():
    exchange = CodesExchange(max_payload=100)

    async def push(header, *buffers):
        async def messages():
            for i, b in enumerate(buffers):
                yield averaging_pb2.DownloadData(metadata=header if i == 0 else b"",
                                                 tensor_part=runtime_pb2.Tensor(buffer=b))
        return await exchange.receive(messages(), "peerA")

    group = serializer.dumps(dict(group=b"g1"))
    assert asyncio.run(push(group, b"x" * 60, b"x" * 60)) == "part too large"
    assert asyncio.run(push(group, b"x" * 10)) == ""
    assert asyncio.run(push(group, b"x" * 10)) == "duplicate part"
    with pytest.raises(CodesError):
        asyncio.run(push(b"not msgpack", b"x"))
