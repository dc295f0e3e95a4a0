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
def test_a_contribution_out_of_range_or_of_the_wrong_size_is_left_out_and_the_others_still_sum(payload, why):
    fmt = codec.DenseFormat(4, 3)
    own, honest = torch.full((10,), 2, dtype=torch.int64), torch.full((10,), -3, dtype=torch.int64)
    r = reduction(own, {"evil": payload, "honest": fmt.encode(honest, None)})
    assert r.ready.is_set() and not r.error and why in r.dropped["evil"] and set(r.dropped) == {"evil"}
    assert torch.equal(fmt.decode_sum(r.result, 10), own + honest)  # served to every member alike


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


def test_a_part_that_never_comes_is_left_out_once_the_wait_is_over():
    fmt = codec.DenseFormat(4, 3)
    own, honest = torch.full((10,), 1, dtype=torch.int64), torch.full((10,), 2, dtype=torch.int64)
    r = Reduction()
    r.spec, r.own = (["honest", "silent"], 10, fmt), own
    r.payloads["honest"] = fmt.encode(honest, None)

    async def wait():
        await r.settle_soon()
        assert not r.ready.is_set()  # still waiting for the silent member
        await r.cut_off_after(0.01)

    asyncio.run(wait())
    assert r.ready.is_set() and "did not come in time" in r.dropped["silent"]
    assert torch.equal(fmt.decode_sum(r.result, 10), own + honest)


def _honest_parts(seed=0, n=4096, members=4):
    """int4 codes of correlated pseudo-gradients (a shared direction plus each member's own noise)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(n, generator=g)
    xs = [common + 0.7 * torch.randn(n, generator=g) for _ in range(members)]
    scales = codec.agreed_scales([codec.block_maxabs(x) for x in xs], 4)
    return [codec.quantize(x, scales, 4).to(torch.int64) for x in xs], scales


def test_the_robust_filter_leaves_out_random_parts_and_keeps_honest_ones():
    from p2pdiloco.swarm.codes import robust_filter

    parts, _ = _honest_parts()
    own, others = parts[0], {f"h{i}": p for i, p in enumerate(parts[1:], 1)}
    assert robust_filter(others, own) == {}  # no false positive among honest members
    g = torch.Generator().manual_seed(9)
    random = torch.randint(-3, 4, parts[1].shape, generator=g)
    dropped = robust_filter({**others, "random": random}, own)
    assert set(dropped) == {"random"} and "points away" in dropped["random"], dropped


def test_a_reduction_leaves_out_a_part_beyond_its_senders_claims_and_keeps_an_honest_clipped_one():
    """Always on: each sender is held to its own claims (p2pdiloco.core.claims). The honest member whose Δ is 5×
    the others' has its maxima clipped (~12 % of its codes at ±L) and is summed; a member that claims its honest
    statistics and sends ×100 is left out, and why is named."""
    from p2pdiloco.core.claims import block_norms, claims_in_codes
    from p2pdiloco.protocol.island import clip_to_block_median

    g = torch.Generator().manual_seed(3)
    common = torch.randn(4096, generator=g)
    xs = [(5.0 if i == 3 else 1.0) * (common + 0.7 * torch.randn(4096, generator=g)) for i in range(5)]
    clipped, over = clip_to_block_median([codec.block_maxabs(x) for x in xs], 2.0)
    scales = codec.agreed_scales(clipped, 4)
    sent = xs[:4] + [xs[4] * 100]
    parts = [codec.quantize(x, scales, 4).to(torch.int64) for x in sent]
    assert 0.05 < float((parts[3].abs() == 7).double().mean()) < 0.5
    fmt = codec.DenseFormat(4, 5)
    r = Reduction()
    r.spec, r.own = (["h1", "h2", "big", "evil"], parts[0].numel(), fmt), parts[0]
    names = ["me", "h1", "h2", "big", "evil"]
    r.claims = {names[i]: claims_in_codes(clipped[i], over[i], block_norms(xs[i]), 1.0, scales, 7) for i in range(5)}
    r.payloads.update({names[i]: fmt.encode(parts[i], None) for i in range(1, 5)})
    r.settle_if_complete()
    assert set(r.dropped) == {"evil"} and "beyond the block maxima it claimed" in r.dropped["evil"]
    assert torch.equal(fmt.decode_sum(r.result, parts[0].numel()), sum(parts[:4]))


def test_a_robust_reduction_sums_only_the_kept_parts():
    parts, _ = _honest_parts(seed=1, members=3)
    fmt = codec.DenseFormat(4, 4)
    flipped = -parts[1]  # a sign-flipping member: in range, plausible size, opposite direction
    r = Reduction(robust=True)
    r.spec, r.own = (["h1", "h2", "evil"], parts[0].numel(), fmt), parts[0]
    r.payloads.update({"h1": fmt.encode(parts[1], None), "h2": fmt.encode(parts[2], None),
                       "evil": fmt.encode(flipped, None)})
    r.settle_if_complete()
    assert set(r.dropped) == {"evil"}
    assert torch.equal(fmt.decode_sum(r.result, parts[0].numel()), parts[0] + parts[1] + parts[2])


def test_a_part_missing_a_sender_is_scaled_back_to_a_weighted_mean():
    from p2pdiloco.swarm.averager import reweigh_parts

    merged = torch.tensor([0.6, 0.6, 0.6, 0.6])  # two parts; the second reducer left out "c" (weight 0.4)
    reweigh_parts(merged, [(0, 2), (2, 4)], [frozenset(), frozenset({"c"})], {"a": 0.3, "b": 0.3, "c": 0.4})
    assert merged.tolist() == pytest.approx([0.6, 0.6, 1.0, 1.0])


class LoopbackStub:
    """A member's rpc_codes_* as another member sees them, in one process; `hold_fetch` delays fetches."""

    def __init__(self, exchange: CodesExchange, caller: str, hold_fetch: asyncio.Event | None = None):
        self.exchange, self.caller, self.hold_fetch = exchange, caller, hold_fetch

    async def rpc_codes_push(self, messages):
        error = await self.exchange.receive(messages, self.caller)

        async def answer():
            yield averaging_pb2.DownloadData(metadata=serializer.dumps(dict(error=error)) if error else b"")
        return answer()

    async def rpc_codes_fetch(self, request):
        if self.hold_fetch is not None:
            await self.hold_fetch.wait()

        async def answer():
            async for metadata, chunk in self.exchange.serve(request, timeout=1.0):
                yield averaging_pb2.DownloadData(metadata=metadata, tensor_part=runtime_pb2.Tensor(buffer=chunk))
        return answer()


def test_a_member_that_fetches_after_the_reducer_finished_its_round_still_gets_the_sum():
    """The reducer's round can end before a slower member asked for its part's sum; the sum must still be
    served, or that member rolls back while the reducer commits (a split the swarm then has to heal)."""
    n, fmt = 2 * codec.BLOCK, codec.DenseFormat(4, 2)
    ex = {name: CodesExchange(max_payload=1 << 20) for name in "ab"}
    codes = {"a": torch.full((n,), 3, dtype=torch.int64), "b": torch.full((n,), -1, dtype=torch.int64)}
    selected = torch.ones(n, dtype=torch.bool)

    async def both():
        a_done = asyncio.Event()
        stubs = {("a", "b"): LoopbackStub(ex["b"], "a"), ("b", "a"): LoopbackStub(ex["a"], "b", hold_fetch=a_done)}

        async def member(me):
            other = "b" if me == "a" else "a"
            result = await ex[me].run(b"g", ["a", "b"], ["a", "b"], me, codes[me], selected, fmt,
                                      lambda peer: stubs[(me, peer)], timeout=3.0)
            if me == "a":
                a_done.set()
            return result
        return await asyncio.gather(member("a"), member("b"))

    (sums_a, *_), (sums_b, *_) = asyncio.run(both())
    sum_a, sum_b = torch.cat(sums_a), torch.cat(sums_b)  # the parts, in order
    assert torch.equal(sum_a, sum_b) and torch.equal(sum_a, codes["a"] + codes["b"])


def test_a_client_mode_member_sends_and_fetches_but_is_never_dialled_and_all_get_the_same_sum():
    """c sits behind a NAT: a and b reduce the two parts; c pushes to both and fetches both sums, and nobody
    opens a stream to c. Every member ends with the exact sum of all three members' codes."""
    n, fmt = 3 * codec.BLOCK, codec.DenseFormat(4, 3)
    ex = {name: CodesExchange(max_payload=1 << 20) for name in "abc"}
    codes = {name: torch.randint(-7, 8, (n,), generator=torch.Generator().manual_seed(i)) for i, name in enumerate("abc")}
    selected = torch.ones(n, dtype=torch.bool)

    def stub_of(me):
        def stub(peer):
            assert peer != "c", f"{me} dialled the client-mode member"
            return LoopbackStub(ex[peer], me)
        return stub

    async def all_three():
        return await asyncio.gather(*(ex[me].run(b"g", ["a", "b", "c"], ["a", "b"], me, codes[me], selected, fmt,
                                                 stub_of(me), timeout=3.0) for me in "abc"))

    results = asyncio.run(all_three())
    expected = codes["a"] + codes["b"] + codes["c"]
    for sums, left_out, dropped in results:
        assert len(sums) == 2 and torch.equal(torch.cat(sums).to(torch.int64), expected)
        assert left_out == [frozenset(), frozenset()] and dropped == {}
    assert "g".encode() not in ex["c"].reductions  # the client reduced nothing


def test_pushes_under_made_up_group_ids_cannot_evict_a_round_in_progress():
    exchange = CodesExchange(max_payload=1 << 20)
    ours = exchange.reduction(b"ours")
    ours.spec = (["p1"], 10, codec.DenseFormat(4, 2))
    for i in range(50):
        exchange.reduction(f"junk{i}".encode())
    assert exchange.reductions.get(b"ours") is ours


def test_every_member_refuses_a_sum_beyond_its_senders_claims_and_blames_the_reducer_that_served_it():
    """b reduces the second part and serves the others 20× its sum (clamped to the sum's 6 bits). Each member holds
    every sender's claims (p2pdiloco.core.claims), so a and c find that sum impossible: both roll back and name b
    (b itself may keep what it likes: the honest members agree with each other). The honest sum passes the same
    check (the claims are those of the codes actually sent)."""
    from p2pdiloco.core.claims import block_norms, claims_in_codes

    n, fmt = 4 * codec.BLOCK, codec.DenseFormat(4, 3)
    g = torch.Generator().manual_seed(5)
    xs = {name: torch.randn(n, generator=g) for name in "abc"}
    scales = codec.agreed_scales([codec.block_maxabs(x) for x in xs.values()], 4)
    codes = {name: codec.quantize(x, scales, 4).to(torch.int64) for name, x in xs.items()}
    claims = {name: claims_in_codes(codec.block_maxabs(x), torch.zeros(4, dtype=torch.bool), block_norms(x), 1.0,
                                    scales, 7) for name, x in xs.items()}
    selected = torch.ones(n, dtype=torch.bool)

    class Forging(LoopbackStub):
        async def rpc_codes_fetch(self, request):
            honest = await super().rpc_codes_fetch(request)

            async def answer():
                messages = [m async for m in honest]
                total = (fmt.decode_sum(b"".join(m.tensor_part.buffer for m in messages), n // 2) * 20).clamp(-31, 31)
                yield averaging_pb2.DownloadData(metadata=messages[0].metadata,
                                                 tensor_part=runtime_pb2.Tensor(buffer=fmt.encode_sum(total)))
            return answer()

    def run_round(forge: bool):
        ex = {name: CodesExchange(max_payload=1 << 20) for name in "abc"}

        def stub_of(me):
            return lambda peer: (Forging if forge and peer == "b" else LoopbackStub)(ex[peer], me)

        async def all_three():
            return await asyncio.gather(*(ex[me].run(b"g", ["a", "b", "c"], ["a", "b"], me, codes[me], selected, fmt,
                                                     stub_of(me), timeout=3.0, claims=claims) for me in "abc"),
                                        return_exceptions=True)
        return asyncio.run(all_three())

    for sums, _, _ in run_round(forge=False):
        assert torch.equal(torch.cat(sums).to(torch.int64), sum(codes.values()))
    forged = run_round(forge=True)
    honest = forged[0], forged[2]
    assert all(isinstance(r, CodesError) and r.culprits == frozenset({"b"}) and "beyond" in str(r)
               for r in honest), honest
