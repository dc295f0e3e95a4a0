"""The reducer side of compressed rounds, without a network: it sums only complete, in-range contributions."""

import asyncio
import functools
import time

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2

from p2pdiloco.core import codec
from p2pdiloco.runtime.pace import BURST_SECONDS, UploadPace
from p2pdiloco.swarm.codes import (AHEAD, LATE, PIECE, Codes, CodesError, CodesExchange, Reduction, codec_cpu_seconds,
                                   faults_and_late, off_loop, part_ranges, piece_ranges, serializer)


def test_parts_cover_every_element_once_at_block_boundaries():
    for n, members, align in ((10, 3, 1), (7, 7, 1), (100_003, 16, 1), (100_003, 4, 16384), (5, 3, 16384)):
        ranges = part_ranges(n, members, align)
        assert len(ranges) == members and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(a % align == 0 for a, b in ranges if b > a)  # empty parts (fewer blocks than members) sit at n
        sizes = [-(-(b - a) // align) for a, b in ranges]
        assert max(sizes) - min(sizes) <= 1


def made(codes, selected) -> Codes:
    """Codes already made, served a piece at a time."""
    return Codes(codes.numel(), lambda a, b: (codes[a:b], selected[a:b]))


def mine(own) -> Codes:
    """Our own codes of the part we reduce."""
    return Codes(own.numel(), lambda a, b: (own[a:b], None))


def reduction(own, payloads, fmt=None, claims=None, robust=False):
    """A reduction of one piece (every part here is smaller than PIECE), with every sender's codes in."""
    r = Reduction(robust=robust)
    r.begin(list(payloads), mine(own), fmt or codec.DenseFormat(4, len(payloads) + 1), claims)
    for sender, data in payloads.items():
        assert r.add(sender, 0, data, max_pieces=1) == ""
    asyncio.run(r.settle_soon())
    return r


def test_a_complete_reduction_is_the_exact_sum_packed_at_its_width():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(-7, 8, (1001,), generator=g) for _ in range(4)]
    fmt = codec.DenseFormat(4, 4)
    r = reduction(parts[0], {f"p{i}": fmt.encode(parts[i], None) for i in range(1, 4)})
    assert r.ready and not r.error
    assert torch.equal(fmt.decode_sum(r.pieces[0].result, 1001), sum(parts))
    assert len(codec.expand(r.pieces[0].result, 1 << 20)) == codec.packed_bytes(1001, codec.sum_width(4, 4))


def test_a_reduction_waits_for_every_member_and_never_serves_a_partial_sum():
    own = torch.zeros(10, dtype=torch.int64)
    r = Reduction()
    fmt = codec.DenseFormat(4, 3)
    r.begin(["p1", "p2"], mine(own), fmt)
    r.add("p1", 0, fmt.encode(own, None), 1)
    asyncio.run(r.settle_soon())
    assert not r.ready and r.pieces[0].result is None  # p2's part is still missing
    r.add("p2", 0, fmt.encode(own + 1, None), 1)
    asyncio.run(r.settle_soon())
    assert r.ready and torch.equal(fmt.decode_sum(r.pieces[0].result, 10), own + 1)


@pytest.mark.parametrize("payload, why", [
    (codec.compress(codec.pack(torch.full((10,), -8), 4)), "beyond ±7"),  # fits 4 bits, not a valid int4 code
    (bytes([codec.RAW]) + b"\x00" * 3, "malformed part"),  # wrong length
    (codec.compress(b"\x00" * 5000), "malformed part"),  # expands beyond the part's length: refused, not expanded
    (b"\x07" + b"\x00" * 5, "malformed part"),  # an unknown encoding
])
def test_a_contribution_out_of_range_or_of_the_wrong_size_is_left_out_and_the_others_still_sum(payload, why):
    fmt = codec.DenseFormat(4, 3)
    own, honest = torch.full((10,), 2, dtype=torch.int64), torch.full((10,), -3, dtype=torch.int64)
    r = reduction(own, {"evil": payload, "honest": fmt.encode(honest, None)})
    assert r.ready and not r.error and why in r.dropped["evil"] and set(r.dropped) == {"evil"}
    assert torch.equal(fmt.decode_sum(r.pieces[0].result, 10), own + honest)  # served to every member alike


def test_pushes_are_bounded_and_checked_before_they_are_kept():
    exchange = CodesExchange(max_payload=100)

    async def push(header, *buffers):
        async def messages():
            for i, b in enumerate(buffers):
                yield averaging_pb2.DownloadData(metadata=header if i == 0 else b"",
                                                 tensor_part=runtime_pb2.Tensor(buffer=b))
        return await exchange.receive(messages(), "peerA")

    assert asyncio.run(push(serializer.dumps(dict(group=b"g1")), b"x" * 60, b"x" * 60)) == "part too large"
    group = serializer.dumps(dict(group=b"g2"))
    assert asyncio.run(push(group, b"x" * 10)) == ""
    assert asyncio.run(push(group, b"x" * 10)) == "duplicate part"
    exchange.max_pieces = 3  # the whole model's pieces: a push of more, before we know our part, is refused
    assert asyncio.run(push(serializer.dumps(dict(group=b"g3")), *[b"x"] * 4)) == "more pieces than the part has"
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
    raw = codec.expand(good, 1 << 20)
    reversed_indices = codec.compress(bytes(reversed(raw[:index_bytes])) + raw[index_bytes:])
    for bad in (dense, good[:-1], reversed_indices):
        with pytest.raises(ValueError):
            fmt.decode(bad, n)


def test_a_strangers_part_is_refused_and_cannot_stall_the_members_sum():
    exchange = CodesExchange(max_payload=1 << 20)
    group = b"g2"
    reduction = exchange.reduction(group)
    own = torch.zeros(10, dtype=torch.int64)
    reduction.add("early-stranger", 0, b"junk", 1)  # arrived before we knew the group: kept aside, never summed
    reduction.begin(["p1"], mine(own), codec.DenseFormat(4, 2))

    async def push(sender, data):
        async def messages():
            yield averaging_pb2.DownloadData(metadata=serializer.dumps(dict(group=group)),
                                             tensor_part=runtime_pb2.Tensor(buffer=data))
        return await exchange.receive(messages(), sender)

    async def pushes():
        fmt = reduction.spec[2]
        assert await push("stranger", fmt.encode(own, None)) == "not a member of this group"
        assert await push("p1", fmt.encode(own + 2, None)) == ""
        await asyncio.gather(*reduction.summing)  # each piece is summed in the background as it completes

    asyncio.run(pushes())
    fmt = reduction.spec[2]
    assert reduction.ready and not reduction.error
    assert torch.equal(fmt.decode_sum(reduction.pieces[0].result, 10), own + 2)


def test_a_part_that_never_comes_is_left_out_once_the_wait_is_over():
    fmt = codec.DenseFormat(4, 3)
    own, honest = torch.full((10,), 1, dtype=torch.int64), torch.full((10,), 2, dtype=torch.int64)
    r = Reduction()
    r.begin(["honest", "silent"], mine(own), fmt)
    r.add("honest", 0, fmt.encode(honest, None), 1)

    async def wait():
        await r.settle_soon()
        assert not r.ready  # still waiting for the silent member
        await r.cut_off_after(0.01)

    asyncio.run(wait())
    assert r.ready and "did not come in time" in r.dropped["silent"]
    assert torch.equal(fmt.decode_sum(r.pieces[0].result, 10), own + honest)


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
    names = ["me", "h1", "h2", "big", "evil"]
    claims = {names[i]: claims_in_codes(clipped[i], over[i], block_norms(xs[i]), 1.0, scales, 7) for i in range(5)}
    r = reduction(parts[0], {names[i]: fmt.encode(parts[i], None) for i in range(1, 5)}, fmt, claims)
    assert set(r.dropped) == {"evil"} and "beyond the block maxima it claimed" in r.dropped["evil"]
    assert torch.equal(fmt.decode_sum(r.pieces[0].result, parts[0].numel()), sum(parts[:4]))


def test_a_robust_reduction_sums_only_the_kept_parts():
    parts, _ = _honest_parts(seed=1, members=3)
    fmt = codec.DenseFormat(4, 4)
    flipped = -parts[1]  # a sign-flipping member: in range, plausible size, opposite direction
    r = reduction(parts[0], {"h1": fmt.encode(parts[1], None), "h2": fmt.encode(parts[2], None),
                             "evil": fmt.encode(flipped, None)}, fmt, robust=True)
    assert set(r.dropped) == {"evil"}
    assert torch.equal(fmt.decode_sum(r.pieces[0].result, parts[0].numel()), parts[0] + parts[1] + parts[2])


def test_a_piece_missing_a_sender_is_scaled_back_to_a_weighted_mean():
    from p2pdiloco.protocol.merge import reweigh

    weights = {"a": 0.3, "b": 0.3, "c": 0.4}
    whole, missing_c = torch.tensor([0.6, 0.6]), torch.tensor([0.6, 0.6])  # the second piece's reducer left out c
    reweigh(whole, frozenset(), weights)
    reweigh(missing_c, frozenset({"c"}), weights)
    assert whole.tolist() == pytest.approx([0.6, 0.6]) and missing_c.tolist() == pytest.approx([1.0, 1.0])
    # weights whose total is under 1 (a stale member discounted): scaled back to that total, not to 1
    discounted = {"a": 0.4, "b": 0.4, "stale": 0.1}
    missing_b = torch.tensor([0.5, 0.5])  # a's and the stale member's 0.5 of a common value 1
    reweigh(missing_b, frozenset({"b"}), discounted)
    assert missing_b.tolist() == pytest.approx([0.9, 0.9])


class LoopbackStub:
    """A member's rpc_codes_* as another member sees them, in one process; `hold_fetch` delays fetches."""

    def __init__(self, exchange: CodesExchange, caller: str, hold_fetch: asyncio.Event | None = None):
        self.exchange, self.caller, self.hold_fetch = exchange, caller, hold_fetch

    async def rpc_codes_push(self, messages):
        reply = await self.exchange.push_answer(messages, self.caller)

        async def answer():
            yield reply
        return answer()

    async def rpc_codes_fetch(self, requests):
        if self.hold_fetch is not None:
            await self.hold_fetch.wait()
        return self.exchange.fetch_answers(requests, 1.0, self.caller)


class DiesAfterOnePiece(LoopbackStub):
    """A reducer whose stream of sums stops after the first piece."""

    async def rpc_codes_fetch(self, request):
        served = await super().rpc_codes_fetch(request)

        async def answer():
            yield await served.__anext__()
        return answer()


def test_a_reducer_holds_its_stream_of_sums_open_until_the_fetcher_has_every_piece():
    """A reducer that closed its stream right after its last piece lost that piece now and then on the testbed:
    the libp2p daemon resets a stream whose handler closed while it still reads the other way, and the reset drops
    what the fetcher's daemon had not read yet. So the fetcher ends its requests once the last piece and the
    reducer's account of the part are in, and only then does the reducer's stream end. Each fetch here records what happened in which order."""
    n, fmt = 4 * PIECE, codec.DenseFormat(4, 2)  # two members: each reduces a part of two pieces
    ex = {name: CodesExchange(max_payload=1 << 20) for name in "ab"}
    codes = {"a": torch.full((n,), 3, dtype=torch.int64), "b": torch.full((n,), -1, dtype=torch.int64)}
    selected = torch.ones(n, dtype=torch.bool)
    events = {"a": [], "b": []}

    class Recording(LoopbackStub):
        async def rpc_codes_fetch(self, requests):
            log = events[self.caller]

            async def watched():
                async for request in requests:
                    yield request
                log.append("fetcher has all")

            served = await super().rpc_codes_fetch(watched())

            async def answer():
                async for message in served:
                    log.append("account" if message.metadata and "account" in serializer.loads(message.metadata)
                               else "piece")
                    yield message
                log.append("closed")
            return answer()

    async def both():
        stubs = {("a", "b"): Recording(ex["b"], "a"), ("b", "a"): Recording(ex["a"], "b")}
        return await asyncio.gather(*(ex[me].run(b"g", ["a", "b"], ["a", "b"], me, made(codes[me], selected), fmt,
                                                 lambda peer, me=me: stubs[(me, peer)], timeout=3.0)
                                      for me in "ab"))

    results = asyncio.run(both())
    assert events == {m: ["piece", "piece", "account", "fetcher has all", "closed"] for m in "ab"}
    assert all(torch.equal(torch.cat(r.sums), torch.full((n,), 2, dtype=torch.int64)) for r in results)


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
            result = await ex[me].run(b"g", ["a", "b"], ["a", "b"], me, made(codes[me], selected), fmt,
                                      lambda peer: stubs[(me, peer)], timeout=3.0)
            if me == "a":
                a_done.set()
            return result
        return await asyncio.gather(member("a"), member("b"))

    a, b = asyncio.run(both())
    sum_a, sum_b = torch.cat(a.sums), torch.cat(b.sums)  # the pieces, in order
    assert torch.equal(sum_a, sum_b) and torch.equal(sum_a, codes["a"] + codes["b"])
    # once the round is over and every other member was served, a reducer holds no sums
    for me in "ab":
        (mine,) = ex[me].reductions.values()
        assert mine.released and all(p.result is None for p in mine.pieces.values()), me


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
        return await asyncio.gather(*(ex[me].run(b"g", ["a", "b", "c"], ["a", "b"], me, made(codes[me], selected), fmt,
                                                 stub_of(me), timeout=3.0) for me in "abc"))

    results = asyncio.run(all_three())
    expected = codes["a"] + codes["b"] + codes["c"]
    for r in results:
        assert r.ranges == [(0, 2 * codec.BLOCK), (2 * codec.BLOCK, n)]
        assert torch.equal(torch.cat(r.sums).to(torch.int64), expected)
        assert r.left_out == [frozenset(), frozenset()] and r.dropped == {}
    assert "g".encode() not in ex["c"].reductions  # the client reduced nothing


def test_pushes_under_made_up_group_ids_cannot_evict_a_round_in_progress():
    exchange = CodesExchange(max_payload=1 << 20)
    ours = exchange.reduction(b"ours")
    ours.begin(["p1"], mine(torch.zeros(10, dtype=torch.int64)), codec.DenseFormat(4, 2))
    for i in range(50):
        exchange.reduction(f"junk{i}".encode())
    assert exchange.reductions.get(b"ours") is ours


def forging(fmt, length: int, limit: int, factor: int = 20) -> type:
    """A reducer's stub that serves `factor` × each honest sum of a piece of `length` elements, clamped to the
    sum's range ±`limit` (a part of one piece)."""
    class Forging(LoopbackStub):
        async def rpc_codes_fetch(self, request):
            honest = await super().rpc_codes_fetch(request)

            async def answer():
                async for message in honest:
                    total = (fmt.decode_sum(message.tensor_part.buffer, length) * factor).clamp(-limit, limit)
                    yield averaging_pb2.DownloadData(metadata=message.metadata,
                                                     tensor_part=runtime_pb2.Tensor(buffer=fmt.encode_sum(total)))
            return answer()
    return Forging


def claimed_codes(names: str, n: int, seed: int, bits: int = 4) -> tuple[dict, dict]:
    """Each sender's codes (int4, or --compression none's 20 bits) of a random Δ on the group's agreed scales, and
    its claims (p2pdiloco.core.claims)."""
    from p2pdiloco.core.claims import block_norms, claims_in_codes
    from p2pdiloco.core.exact import n_blocks

    g = torch.Generator().manual_seed(seed)
    xs = {name: torch.randn(n, generator=g) for name in names}
    scales = codec.agreed_scales([codec.block_maxabs(x) for x in xs.values()], bits)
    codes = {name: codec.quantize(x, scales, bits).to(torch.int64) for name, x in xs.items()}
    claims = {name: claims_in_codes(codec.block_maxabs(x), torch.zeros(n_blocks(n), dtype=torch.bool), block_norms(x),
                                    1.0, scales, codec.levels(bits)) for name, x in xs.items()}
    return codes, claims


def test_every_member_refuses_a_sum_beyond_its_senders_claims_and_blames_the_reducer_that_served_it():
    """b reduces the second part and serves the others 20× its sum (clamped to the sum's 6 bits). Each member holds
    every sender's claims (p2pdiloco.core.claims), so a and c find that sum impossible: both roll back and name b
    (b itself may keep what it likes: the honest members agree with each other). The honest sum passes the same
    check (the claims are those of the codes actually sent)."""
    n, fmt = 4 * codec.BLOCK, codec.DenseFormat(4, 3)
    codes, claims = claimed_codes("abc", n, seed=5)
    selected = torch.ones(n, dtype=torch.bool)

    Forging = forging(fmt, n // 2, limit=31)  # b's part is one piece

    def run_round(forge: bool):
        ex = {name: CodesExchange(max_payload=1 << 20) for name in "abc"}

        def stub_of(me):
            return lambda peer: (Forging if forge and peer == "b" else LoopbackStub)(ex[peer], me)

        async def all_three():
            return await asyncio.gather(*(ex[me].run(b"g", ["a", "b", "c"], ["a", "b"], me, made(codes[me], selected),
                                                     fmt, stub_of(me), timeout=3.0, claims=claims) for me in "abc"),
                                        return_exceptions=True)
        return asyncio.run(all_three())

    for r in run_round(forge=False):
        assert torch.equal(torch.cat(r.sums).to(torch.int64), sum(codes.values()))
    forged = run_round(forge=True)
    honest = forged[0], forged[2]
    assert all(isinstance(r, CodesError) and r.culprits == frozenset({"b"}) and "beyond" in str(r)
               for r in honest), honest


def test_a_reducer_serves_each_piece_as_soon_as_every_sender_sent_it():
    """The round streams: piece 0's sum goes out while piece 1 has not come from anyone yet, so packing, sending,
    summing and fetching overlap instead of running as phases."""
    fmt = codec.DenseFormat(4, 3)
    n = PIECE + 3 * codec.BLOCK
    own = torch.ones(n, dtype=torch.int64)
    senders = {name: torch.full((n,), v, dtype=torch.int64) for name, v in (("p1", 2), ("p2", -3))}
    pieces = piece_ranges(0, n)
    assert pieces == [(0, PIECE), (PIECE, n)]
    exchange = CodesExchange(max_payload=1 << 22)
    r = exchange.reduction(b"g")
    r.begin(list(senders), mine(own), fmt)
    request = averaging_pb2.DownloadData(metadata=serializer.dumps(dict(group=b"g")))

    async def stream():
        for name, codes in senders.items():
            r.add(name, 0, fmt.encode(codes[:PIECE], None), 2)
            r.settle_in_background(0)
        served = exchange.serve(request, timeout=5.0)
        header, first = await served.__anext__()
        assert r.pieces[1].payloads == {} and not r.pieces[1].ready.is_set()  # nobody's piece 1 yet
        assert serializer.loads(header) == dict(dropped=[])
        assert torch.equal(fmt.decode_sum(first, PIECE), (own + 2 - 3)[:PIECE])
        for name, codes in senders.items():
            r.add(name, 1, fmt.encode(codes[PIECE:], None), 2)
            r.settle_in_background(1)
        _, second = await served.__anext__()
        assert torch.equal(fmt.decode_sum(second, n - PIECE), (own + 2 - 3)[PIECE:])

    asyncio.run(stream())


def test_a_reducer_makes_its_own_codes_a_piece_at_a_time_as_each_piece_is_summed():
    """Its own codes of the whole part would be 4 bytes per element of it (2 per parameter in an island of 2)."""
    fmt = codec.DenseFormat(4, 2)
    n = 2 * PIECE
    own, other = torch.ones(n, dtype=torch.int64), torch.full((n,), 2, dtype=torch.int64)
    asked = []

    def own_of(a, b):
        asked.append((a, b))
        return own[a:b], None

    r = Reduction()
    r.begin(["p1"], Codes(n, own_of), fmt)
    assert asked == []
    r.add("p1", 0, fmt.encode(other[:PIECE], None), 2)
    asyncio.run(r.settle_soon())
    assert asked == [(0, PIECE)] and torch.equal(fmt.decode_sum(r.pieces[0].result, PIECE), (own + other)[:PIECE])
    r.add("p1", 1, fmt.encode(other[PIECE:], None), 2)
    asyncio.run(r.settle_soon())
    assert asked == [(0, PIECE), (PIECE, n)] and r.ready


def test_a_sender_that_stops_mid_part_is_left_out_of_the_pieces_it_did_not_send_only():
    """p2 sent piece 0 and went silent: piece 0 sums all three; piece 1 (after the cut-off) leaves p2 out and says
    so, and what p2 sends for it later is not kept."""
    fmt = codec.DenseFormat(4, 3)
    n = 2 * PIECE
    own, c1, c2 = (torch.full((n,), v, dtype=torch.int64) for v in (1, 2, 4))
    r = Reduction()
    r.begin(["p1", "p2"], mine(own), fmt)
    for index, (a, b) in enumerate(piece_ranges(0, n)):
        r.add("p1", index, fmt.encode(c1[a:b], None), 2)
    r.add("p2", 0, fmt.encode(c2[:PIECE], None), 2)

    async def rest():
        await r.settle_soon()
        assert r.pieces[0].ready.is_set() and not r.pieces[1].ready.is_set()
        await r.cut_off_after(0.01)

    asyncio.run(rest())
    assert r.pieces[0].dropped == {} and set(r.pieces[1].dropped) == {"p2"}
    assert torch.equal(fmt.decode_sum(r.pieces[0].result, PIECE), (own + c1 + c2)[:PIECE])
    assert torch.equal(fmt.decode_sum(r.pieces[1].result, PIECE), (own + c1)[PIECE:])
    assert r.add("p2", 1, fmt.encode(c2[PIECE:], None), 2) == "" and r.pieces[1].payloads == {}


def test_a_sender_that_only_came_late_is_told_apart_from_one_that_sent_garbage_even_behind_a_late_piece():
    """Lateness is not blamed at once (protocol.island.Stragglers), so a sender must not pass a malformed piece off
    as a late one: p1 missed piece 0's cut-off and sent garbage for piece 1; p2 only missed the cut-off."""
    fmt = codec.DenseFormat(4, 3)
    n = 2 * PIECE
    own = torch.ones(n, dtype=torch.int64)
    r = Reduction()
    r.begin(["p1", "p2"], mine(own), fmt)
    r.add("p1", 1, b"\x07garbage", 2)

    async def cut_off():
        await r.cut_off_after(0.01)

    asyncio.run(cut_off())
    assert r.pieces[0].dropped == {"p1": LATE, "p2": LATE} and "malformed" in r.pieces[1].dropped["p1"]
    assert "malformed" in r.dropped["p1"] and r.dropped["p2"] == LATE
    assert faults_and_late(r.dropped) == (frozenset({"p1"}), frozenset({"p2"}))


def test_a_sender_whose_part_never_came_is_reported_late_and_is_no_culprit_of_a_failed_round():
    """s, a client-mode member, never sends: both reducers sum without it after the cut-off, and a round that fails
    for another reason (b's sum stops mid-stream) names b as its culprit and s only as left out for lateness."""
    n, fmt = 4 * PIECE, codec.DenseFormat(4, 3)  # two parts of two pieces
    codes = {name: torch.randint(-7, 8, (n,), generator=torch.Generator().manual_seed(i))
             for i, name in enumerate("ab")}
    selected = torch.ones(n, dtype=torch.bool)

    def run_round(dying: bool):
        ex = {name: CodesExchange(max_payload=1 << 22) for name in "ab"}

        def stub_of(me):
            return lambda peer: (DiesAfterOnePiece if dying and peer == "b" else LoopbackStub)(ex[peer], me)

        async def both():
            return await asyncio.gather(*(ex[me].run(b"g", ["a", "b", "s"], ["a", "b"], me, made(codes[me], selected),
                                                     fmt, stub_of(me), timeout=1.0) for me in "ab"),
                                        return_exceptions=True)
        return asyncio.run(both())

    for r in run_round(dying=False):
        assert r.dropped == {"s": LATE} and torch.equal(torch.cat(r.sums).to(torch.int64), codes["a"] + codes["b"])
    a, _ = run_round(dying=True)
    assert isinstance(a, CodesError) and a.culprits == frozenset({"b"}) and a.dropped == {"s": LATE}


def test_a_round_of_many_pieces_ends_with_the_exact_sum_and_a_reducer_that_dies_mid_stream_fails_it():
    n, fmt = 2 * PIECE + 5 * codec.BLOCK + 7, codec.DenseFormat(4, 2)
    codes = {name: torch.randint(-7, 8, (n,), generator=torch.Generator().manual_seed(i))
             for i, name in enumerate("ab")}
    selected = torch.ones(n, dtype=torch.bool)

    landed = {name: torch.zeros(n, dtype=torch.int64) for name in "ab"}

    def land(me, start, end, total, left_out):
        assert left_out == frozenset()
        landed[me][start:end] += total

    def run_round(dying: bool, landing: bool = False):
        ex = {name: CodesExchange(max_payload=1 << 22) for name in "ab"}

        def stub_of(me):
            return lambda peer: (DiesAfterOnePiece if dying and peer == "b" else LoopbackStub)(ex[peer], me)

        async def both():
            return await asyncio.gather(*(ex[me].run(b"g", ["a", "b"], ["a", "b"], me, made(codes[me], selected), fmt,
                                                     stub_of(me), timeout=3.0,
                                                     land=functools.partial(land, me) if landing else None)
                                          for me in "ab"), return_exceptions=True)
        return asyncio.run(both())

    for r in run_round(dying=False):
        assert len(r.ranges) == 4 and r.ranges[0][0] == 0 and r.ranges[-1][1] == n  # two parts, two pieces each
        assert all(x[1] == y[0] for x, y in zip(r.ranges, r.ranges[1:]))
        assert torch.equal(torch.cat(r.sums).to(torch.int64), codes["a"] + codes["b"])
    for r in run_round(dying=False, landing=True):  # each piece landed as it came, once, and none kept
        assert r.sums == [] and len(r.left_out) == 4
    assert all(torch.equal(landed[me], codes["a"] + codes["b"]) for me in "ab")
    a, _ = run_round(dying=True)
    assert isinstance(a, CodesError) and "incomplete: 1 of 2 pieces" in str(a) and a.culprits == frozenset({"b"})


@pytest.mark.parametrize("reducer_b", ["slow", "says late", "round ended first", "refuses"])
def test_a_reducer_whose_sum_came_late_is_reported_late_and_one_that_refused_is_a_culprit(reducer_b):
    """Late is a matter of when: b's sum that did not come before our wait ended, or b saying its own round ended
    before its sum was complete (a busy CPU does both to an honest peer), is reported as late (blamed only when late
    again, as a late sender); b refusing to serve it is a culprit at once. a's error names b either way."""
    n, fmt = 2 * codec.BLOCK, codec.DenseFormat(4, 2)
    codes = {name: torch.randint(-7, 8, (n,), generator=torch.Generator().manual_seed(i))
             for i, name in enumerate("ab")}
    selected = torch.ones(n, dtype=torch.bool)
    ex = {name: CodesExchange(max_payload=1 << 20) for name in "ab"}

    class B(LoopbackStub):
        async def rpc_codes_fetch(self, request):
            if reducer_b == "slow":
                await asyncio.sleep(2.0)
            elif reducer_b == "round ended first":  # b's own round gave up before its part's sum was complete
                while "a" not in ex["b"].reduction(b"g").pushed:  # after a's push (else that push is refused late)
                    await asyncio.sleep(0.01)
                ex["b"].reduction(b"g").release()
            else:
                async def answer():
                    yield averaging_pb2.DownloadData(metadata=serializer.dumps(
                        dict(error="not serving", **({"late": True} if reducer_b == "says late" else {}))))
                return answer()
            return await super().rpc_codes_fetch(request)

    async def round_of_a():
        ex["b"].reduction(b"g")  # b knows the group: a's push is kept (b itself never runs its round here)
        stubs = {"b": B(ex["b"], "a")}
        return await ex["a"].run(b"g", ["a", "b"], ["a", "b"], "a", made(codes["a"], selected), fmt,
                                 lambda peer: stubs[peer], timeout=1.0)

    with pytest.raises(CodesError) as failed:
        asyncio.run(round_of_a())
    late = reducer_b != "refuses"
    assert (failed.value.late, failed.value.culprits) == ((frozenset({"b"}), frozenset()) if late
                                                          else (frozenset(), frozenset({"b"}))), str(failed.value)
    said = {"slow": "its sums did not come in time", "says late": "not serving", "refuses": "not serving",
            "round ended first": "round ended before its part's sum was complete"}[reducer_b]
    assert "reducer b: " in str(failed.value) and said in str(failed.value), str(failed.value)


def test_a_reducer_lets_each_pieces_sum_go_once_every_member_and_its_own_round_have_it():
    """A reducer held every piece's sum of its part until the last member had the last piece: 1/N of the model
    at the sum's width (150 MB for a 100M model in an island of 2) at the averager's peak. Now a piece's sum goes
    as soon as our own round took it and every other member's fetch was handed it; a second fetch of it is
    refused, not served a hole."""
    from hivemind.utils.serializer import MSGPackSerializer

    n, fmt = 2 * PIECE, codec.DenseFormat(4, 2)
    own, theirs = torch.ones(n, dtype=torch.int64), torch.full((n,), 2, dtype=torch.int64)
    ex = CodesExchange(max_payload=1 << 22)
    r = ex.reduction(b"g")
    r.begin(["b"], mine(own), fmt)
    for i, (a, b) in enumerate(piece_ranges(0, n)):
        assert r.add("b", i, fmt.encode(theirs[a:b], None), max_pieces=2) == ""
    asyncio.run(r.settle_soon())
    request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(group=b"g")))

    async def fetch_while_our_round_takes_its_pieces():
        served = ex.serve(request, 5.0, "b")
        first = await served.__anext__()
        await served.__anext__()  # piece 0 handed over; piece 1 yielded, not yet handed over
        assert torch.equal(fmt.decode_sum(first[1], PIECE), own[:PIECE] + theirs[:PIECE])
        assert r.pieces[0].result is not None  # our own round has not taken it yet
        r.piece_taken(0)
        r.piece_taken(1)
        assert r.pieces[0].result is None and r.pieces[1].result is not None
        account, no_sum = await served.__anext__()  # piece 1 handed over; then the reducer's account of the part
        assert set(serializer.loads(account)["account"]) == {"", "b"} and no_sum == b""
        with pytest.raises(StopAsyncIteration):
            await served.__anext__()
        assert r.pieces[1].result is None and r.fetched == {"b"}
        with pytest.raises(CodesError, match="dropped"):
            await ex.serve(request, 5.0, "b").__anext__()

    asyncio.run(fetch_while_our_round_takes_its_pieces())


def test_the_codec_threads_cpu_is_counted_and_its_waits_are_not():
    """A round records the codec thread's CPU (codec_cpu_seconds in its record): near the round's seconds, the
    round waited on a core. CPU time, not wall time: work counts, a wait in the thread does not."""
    def busy(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    before = codec_cpu_seconds()
    asyncio.run(off_loop(busy, 0.2))
    worked = codec_cpu_seconds() - before
    assert 0.19 <= worked < 0.5
    before = codec_cpu_seconds()
    asyncio.run(off_loop(time.sleep, 0.3))
    assert codec_cpu_seconds() - before < 0.05


@pytest.mark.parametrize("bits", [4, 20], ids=["int4", "fp32-wire"])
@pytest.mark.parametrize("hide", ["nowhere", "own", "victim"])
def test_a_reducer_that_bends_its_sum_within_the_claims_is_caught_by_its_account(bits, hide):
    """b reduces the second part (two pieces) and serves a sum the senders' claims allow: the others' codes
    flipped (p2pdiloco.faults.reducer). The sum check passes it; the account b serves with it does not. Hidden
    nowhere, the shares do not add up to the sum; in b's own share, that share's norm is beyond b's claims: both
    times every other member refuses the round and blames b. Flipping only a's codes and stating a's share as
    flipped, only a can tell, and it blames b (c commits: what it holds is consistent)."""
    from p2pdiloco.faults.reducer import BendingReduction

    n, fmt = 4 * PIECE, codec.DenseFormat(bits, 3)
    codes, claims = claimed_codes("abc", n, seed=7, bits=bits)
    selected = torch.ones(n, dtype=torch.bool)
    ex = {name: CodesExchange(max_payload=1 << 24) for name in "abc"}
    ex["b"].reduction_type = functools.partial(BendingReduction, hide=hide)

    async def all_three():
        return await asyncio.gather(*(ex[me].run(b"g", ["a", "b", "c"], ["a", "b"], me, made(codes[me], selected),
                                                 fmt, lambda peer, me=me: LoopbackStub(ex[peer], me), timeout=5.0,
                                                 claims=claims) for me in "abc"), return_exceptions=True)

    a, b, c = asyncio.run(all_three())
    assert not isinstance(b, BaseException)  # the bender itself may keep what it likes
    bent_part = torch.cat(b.sums).to(torch.int64)[n // 2:]
    honest_part = sum(codes.values())[n // 2:]
    assert not torch.equal(bent_part, honest_part)
    expected = {"nowhere": "do not add up", "own": "its own codes have a norm", "victim": "misstates the codes"}[hide]
    refused = (a, c) if hide != "victim" else (a,)
    for r in refused:
        assert isinstance(r, CodesError) and r.culprits == frozenset({"b"}), r
        assert expected in str(r) and "beyond what" not in str(r) and "sum of norm" not in str(r)  # the sum check passed
    if hide == "victim":
        assert torch.equal(torch.cat(c.sums).to(torch.int64), torch.cat(b.sums).to(torch.int64))


def test_a_reducer_that_serves_no_account_is_blamed():
    """An older reducer, or one that withholds its account: its sums cannot be checked, so they are not taken."""
    n, fmt = 2 * codec.BLOCK, codec.DenseFormat(4, 2)
    codes, claims = claimed_codes("ab", n, seed=3)
    selected = torch.ones(n, dtype=torch.bool)
    ex = {name: CodesExchange(max_payload=1 << 20) for name in "ab"}

    class NoAccount(LoopbackStub):
        async def rpc_codes_fetch(self, requests):
            served = await super().rpc_codes_fetch(requests)

            async def answer():
                async for message in served:
                    if "account" not in serializer.loads(message.metadata):
                        yield message
            return answer()

    async def both():
        stubs = {("a", "b"): NoAccount(ex["b"], "a"), ("b", "a"): LoopbackStub(ex["a"], "b")}
        return await asyncio.gather(*(ex[me].run(b"g", ["a", "b"], ["a", "b"], me, made(codes[me], selected), fmt,
                                                 lambda peer, me=me: stubs[(me, peer)], timeout=3.0, claims=claims)
                                      for me in "ab"), return_exceptions=True)

    a, b = asyncio.run(both())
    assert isinstance(a, CodesError) and a.culprits == frozenset({"b"}) and "without an account" in str(a)
    assert not isinstance(b, BaseException)


def _paced_push(exchange: CodesExchange, name: str, codes: torch.Tensor, fmt, go: asyncio.Event, sent: dict,
                seen: list):
    """`name`'s push of its codes, once `go` is set; `sent` counts the pieces it handed over, `seen` notes how
    many pieces of it the reduction held each time it handed one over."""
    reduction = exchange.reductions[b"g"]

    async def messages():
        await go.wait()
        for i, (a, b) in enumerate(piece_ranges(0, codes.numel())):
            seen.append(sum(name in p.payloads for p in reduction.pieces.values()))
            sent[name] += 1
            yield averaging_pb2.DownloadData(metadata=serializer.dumps(dict(group=b"g")) if i == 0 else b"",
                                             tensor_part=runtime_pb2.Tensor(buffer=fmt.encode(codes[a:b], None)))
    return exchange.receive(messages(), name)


def _fast_and_slow(pieces: int):
    fmt = codec.DenseFormat(4, 3)
    n = pieces * PIECE
    codes = {"fast": torch.full((n,), 2, dtype=torch.int64), "slow": torch.full((n,), -3, dtype=torch.int64)}
    exchange = CodesExchange(max_payload=1 << 30)
    exchange.reduction(b"g").begin(list(codes), mine(torch.ones(n, dtype=torch.int64)), fmt)
    return exchange, codes, fmt


def test_a_fast_senders_push_waits_for_the_slow_ones_so_a_reducer_holds_at_most_a_few_pieces_of_each():
    """Flow control: a reducer does not read a push that is AHEAD pieces past the first piece it could not sum yet,
    so a fast sender waits in its transport instead of parking its whole part in the reducer's memory (a reducer
    node's memory is then bounded by the pieces in flight, not by its senders' parts)."""
    exchange, codes, fmt = _fast_and_slow(AHEAD + 4)
    reduction = exchange.reductions[b"g"]
    sent, seen = {"fast": 0, "slow": 0}, []

    async def both():
        go_fast, go_slow = asyncio.Event(), asyncio.Event()
        go_fast.set()
        fast = asyncio.ensure_future(_paced_push(exchange, "fast", codes["fast"], fmt, go_fast, sent, seen))
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert sent["fast"] == AHEAD and not fast.done()  # it waits for the slow sender's first piece
        go_slow.set()
        slow = _paced_push(exchange, "slow", codes["slow"], fmt, go_slow, sent, [])
        assert await asyncio.gather(fast, slow) == ["", ""]
        await asyncio.gather(*reduction.summing)

    asyncio.run(both())
    assert max(seen) <= AHEAD and sent == {"fast": AHEAD + 4, "slow": AHEAD + 4}
    for index, (a, b) in enumerate(piece_ranges(0, codes["fast"].numel())):
        assert torch.equal(fmt.decode_sum(reduction.pieces[index].result, b - a), torch.full((b - a,), 0))


def test_a_push_waiting_for_a_sender_that_never_comes_goes_on_once_the_wait_is_over():
    exchange, codes, fmt = _fast_and_slow(AHEAD + 2)
    reduction = exchange.reductions[b"g"]

    async def alone():
        go = asyncio.Event()
        go.set()
        fast = _paced_push(exchange, "fast", codes["fast"], fmt, go, {"fast": 0}, [])
        cut = asyncio.ensure_future(reduction.cut_off_after(0.1))
        assert await asyncio.wait_for(fast, 5.0) == ""
        await cut

    asyncio.run(alone())
    assert reduction.ready and reduction.dropped == {"slow": LATE}


def test_a_capped_member_spreads_what_it_sends_at_its_rate_and_the_sum_is_the_same():
    """--upload-mbps: a member's pushes and the sums it serves draw on its cap, so its round lasts at least its
    bytes over the rate, and the sums are the same bits."""
    n, fmt = 4 * PIECE, codec.DenseFormat(4, 2)  # two members: each pushes two pieces and serves two sums
    codes = {name: torch.randint(-7, 8, (n,), generator=torch.Generator().manual_seed(i))  # no zstd gains
             for i, name in enumerate("ab")}
    selected = torch.ones(n, dtype=torch.bool)
    rate = 2e6  # B/s: a's round is about 0.5 MB, so 0.25 s at least
    ex = {"a": CodesExchange(max_payload=1 << 22, pace=UploadPace(rate)), "b": CodesExchange(max_payload=1 << 22)}
    sent = {"a": 0, "b": 0}

    class Counting(LoopbackStub):  # `caller` pushes to, and is served by, the exchange behind this stub
        async def rpc_codes_push(self, messages):
            async def counted():
                async for m in messages:
                    sent[self.caller] += len(m.tensor_part.buffer)
                    yield m
            return await super().rpc_codes_push(counted())

        async def rpc_codes_fetch(self, requests):
            served, server = await super().rpc_codes_fetch(requests), "b" if self.caller == "a" else "a"

            async def counted():
                async for m in served:
                    sent[server] += len(m.tensor_part.buffer)
                    yield m
            return counted()

    async def both():
        stubs = {("a", "b"): Counting(ex["b"], "a"), ("b", "a"): Counting(ex["a"], "b")}
        started = time.monotonic()
        results = await asyncio.gather(*(ex[me].run(b"g", ["a", "b"], ["a", "b"], me, made(codes[me], selected),
                                                    fmt, lambda peer, me=me: stubs[(me, peer)], timeout=30.0)
                                         for me in "ab"))
        return results, time.monotonic() - started

    results, seconds = asyncio.run(both())
    assert sent["a"] > 400_000 and sent["b"] > 400_000
    assert seconds >= sent["a"] / rate - BURST_SECONDS  # a lower bound: a slow machine cannot fail it
    for r in results:
        assert torch.equal(torch.cat(r.sums).to(torch.int64), codes["a"] + codes["b"])
