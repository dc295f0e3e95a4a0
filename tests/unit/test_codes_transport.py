"""The reducer side of compressed rounds, without a network: it sums only complete, in-range contributions."""

import asyncio

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2

from p2pdiloco.core import codec
from p2pdiloco.swarm.codes import CodesError, CodesExchange, Reduction, part_ranges, serializer


def test_parts_cover_every_element_once_at_block_boundaries():
    for n, members, align in ((10, 3, 1), (7, 7, 1), (100_003, 16, 1), (100_003, 4, 16384), (5, 3, 16384)):
        ranges = part_ranges(n, members, align)
        assert len(ranges) == members and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(a % align == 0 for a, b in ranges if b > a)  # empty parts (fewer blocks than members) sit at n
        sizes = [-(-(b - a) // align) for a, b in ranges]
        assert max(sizes) - min(sizes) <= 1


def reduction(own, payloads, bits=4):
    r = Reduction()
    r.spec = (sorted(payloads), own.numel(), codec.DenseFormat(bits, len(payloads) + 1))
    r.own = own
    r.payloads.update(payloads)
    r.settle_if_complete()
    return r


def test_a_complete_reduction_is_the_exact_sum_packed_at_its_width():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(-7, 8, (1001,), generator=g) for _ in range(4)]
    fmt = codec.DenseFormat(4, 4)
    r = reduction(parts[0], {f"p{i}": fmt.encode(parts[i], None) for i in range(1, 4)})
    assert r.ready.is_set() and not r.error
    assert torch.equal(fmt.decode_sum(r.result, 1001), sum(parts))
    assert len(codec.inflate(r.result, 1 << 20)) == codec.packed_bytes(1001, codec.sum_width(4, 4))


def test_a_reduction_waits_for_every_member_and_never_serves_a_partial_sum():
    own = torch.zeros(10, dtype=torch.int64)
    r = Reduction()
    r.spec, r.own = (["p1", "p2"], 10, codec.DenseFormat(4, 3)), own
    fmt = codec.DenseFormat(4, 3)
    r.payloads["p1"] = fmt.encode(own, None)
    r.settle_if_complete()
    assert not r.ready.is_set() and r.result is None  # p2's part is still missing
    r.payloads["p2"] = fmt.encode(own + 1, None)
    r.settle_if_complete()
    assert r.ready.is_set() and torch.equal(fmt.decode_sum(r.result, 10), own + 1)


@pytest.mark.parametrize("payload, why", [
    (codec.deflate(codec.pack(torch.full((10,), -8), 4)), "beyond ±7"),  # fits 4 bits, not a valid int4 code
    (bytes([codec.RAW]) + b"\x00" * 3, "malformed part"),  # wrong length
    (codec.deflate(b"\x00" * 5000), "malformed part"),  # inflates beyond the part's length: refused, not expanded
    (b"\x07" + b"\x00" * 5, "malformed part"),  # an unknown encoding
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


def topk_parts(seed=0, n=2 * 16384 + 100, members=3, fraction=0.02):
    g = torch.Generator().manual_seed(seed)
    fmt = codec.TopKFormat(2, members, fraction)
    xs = [torch.randn(n, generator=g) for _ in range(members)]
    scales = codec.agreed_scales([codec.block_maxabs(x) for x in xs], 2)
    parts = []
    for x in xs:
        selected = fmt.select(x)
        parts.append((codec.quantize(x, scales, 2).to(torch.int64) * selected, selected))
    return fmt, parts, n


def test_top_k_parts_carry_exactly_k_per_block_and_sum_exactly():
    fmt, parts, n = topk_parts()
    total = torch.zeros(n, dtype=torch.int64)
    for codes, selected in parts:
        assert int(selected.sum()) == sum(fmt.k(b - a) for a, b in codec.block_spans(0, n))
        data = fmt.encode(codes, selected)
        assert len(data) * 8 / n < 0.5  # 2 % of the elements at 2 + 14 bits
        assert torch.equal(fmt.decode(data, n), codes)
        total += codes
    assert torch.equal(fmt.decode_sum(fmt.encode_sum(total), n), total)


def test_a_hostile_top_k_part_is_refused():
    fmt, parts, n = topk_parts()
    codes, selected = parts[0]
    dense = codec.DenseFormat(2, 3).encode(codes, selected)  # a dense update where top-k is due
    good = fmt.encode(codes, selected)
    index_bytes = codec.packed_bytes(int(selected.sum()), codec.INDEX_WIDTH)
    raw = codec.inflate(good, 1 << 20)
    reversed_indices = codec.deflate(bytes(reversed(raw[:index_bytes])) + raw[index_bytes:])
    for bad in (dense, good[:-1], reversed_indices):
        with pytest.raises(ValueError):
            fmt.decode(bad, n)


def test_a_strangers_part_is_refused_and_cannot_stall_the_members_sum():
    exchange = CodesExchange(max_payload=1 << 20)
    group = b"g2"
    reduction = exchange.reduction(group)
    own = torch.zeros(10, dtype=torch.int64)
    reduction.spec, reduction.own = (["p1"], 10, codec.DenseFormat(4, 2)), own
    reduction.payloads["early-stranger"] = b"junk"  # arrived before we knew the group: kept aside, never summed

    async def push(sender, data):
        async def messages():
            yield averaging_pb2.DownloadData(metadata=serializer.dumps(dict(group=group)),
                                             tensor_part=runtime_pb2.Tensor(buffer=data))
        return await exchange.receive(messages(), sender)

    fmt = reduction.spec[2]
    assert asyncio.run(push("stranger", fmt.encode(own, None))) == "not a member of this group"
    assert asyncio.run(push("p1", fmt.encode(own + 2, None))) == ""
    assert reduction.ready.is_set() and not reduction.error
    assert torch.equal(fmt.decode_sum(reduction.result, 10), own + 2)
