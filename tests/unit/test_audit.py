"""A reducer's account of its sums (p2pdiloco.core.audit): fingerprints that add up exactly, that any change of the
codes moves, and whose sketch estimates a share's norm well enough to hold it to its sender's claims."""

import hashlib

import pytest
import torch

from p2pdiloco.core import audit
from p2pdiloco.core.audit import OWN, account_why_not, fingerprint, norm_squared, piece_seed, same


def codes(seed: int, n: int = 5000, limit: int = 7) -> torch.Tensor:
    return torch.randint(-limit, limit + 1, (n,), generator=torch.Generator().manual_seed(seed))


SEED = piece_seed(b"group", 0, b"served bytes", ())


def test_fingerprints_add_up_exactly_as_the_codes_do():
    a, b, c = codes(0), codes(1), codes(2, limit=(1 << 25) - 1)  # the largest sums: 64 codes of 20 bits
    assert same(fingerprint(a, SEED) + fingerprint(b, SEED) + fingerprint(c, SEED), fingerprint(a + b + c, SEED))
    assert same(fingerprint(torch.zeros(7, dtype=torch.int64), SEED), audit.zero())


@pytest.mark.parametrize("change", ["one code by one", "two codes swapped", "one code by a lot", "last code"])
def test_any_change_of_the_codes_changes_the_fingerprint(change):
    a = codes(3)
    b = a.clone()
    if change == "one code by one":
        b[100] += 1
    elif change == "two codes swapped":  # the same sum and norm: only the residues and the sketch's places see it
        b[10], b[20] = a[20] + 1, a[10] - 1
    elif change == "one code by a lot":
        b[7] += 1 << 24
    else:
        b[-1] -= 1
    assert not same(fingerprint(a, SEED), fingerprint(b, SEED))


def test_the_seed_depends_on_the_group_the_place_the_bytes_and_who_was_left_out():
    seeds = {piece_seed(b"group", 0, b"served bytes", ()), piece_seed(b"other", 0, b"served bytes", ()),
             piece_seed(b"group", 16384, b"served bytes", ()), piece_seed(b"group", 0, b"served bytez", ()),
             piece_seed(b"group", 0, b"served bytes", ("p1",))}
    assert len(seeds) == 5
    assert piece_seed(b"g", 0, b"x", ("b", "a")) == piece_seed(b"g", 0, b"x", ("a", "b"))
    # the seed is part of the wire: a reducer and its members draw the same fingerprints only where they derive it
    # alike, so a change here needs a new wire version (these values pin it)
    assert piece_seed(b"group", 16384, b"served bytes", ("p2", "p1")) == 72677034680951601844108268980685295048
    assert piece_seed(b"", 0, b"", ()) == 142969120105495649754689305666184089568


def test_the_sketch_estimates_the_norm_within_its_spread():
    for seed in range(5):
        x = codes(seed, n=20000)
        truth = float(x.double().square().sum())
        estimate = norm_squared(fingerprint(x, piece_seed(b"g", seed, b"", ())))
        assert 0.6 * truth < estimate < 1.4 * truth  # relative spread √(2/128)/√2 ≈ 0.09 per estimate


def account(shares: dict) -> dict:
    return {key: fingerprint(v, SEED) for key, v in shares.items()}


def honest(n=4000):
    shares = {OWN: codes(10, n), "a": codes(11, n), "c": codes(12, n)}
    bound = float(codes(10, n).double().square().sum().sqrt()) * 1.05
    return shares, {OWN: bound, "a": bound, "c": bound}


def test_an_honest_account_holds_for_every_member():
    shares, bounds = honest()
    served = fingerprint(sum(shares.values()), SEED)
    for me in ("a", "c", None):
        mine = fingerprint(shares[me], SEED) if me else audit.zero()
        assert account_why_not(account(shares), served, me, mine, bounds) == ""


def test_an_account_that_does_not_add_up_to_the_sum_served_is_refused():
    shares, bounds = honest()
    bent = shares[OWN] - shares["a"] - shares["c"]  # the others flipped: a sum within their claims
    served = fingerprint(bent, SEED)
    why = account_why_not(account(shares), served, "c", fingerprint(shares["c"], SEED), bounds)
    assert "do not add up" in why


def test_a_bent_sum_hidden_in_the_reducers_own_share_is_refused_for_its_norm():
    shares, bounds = honest()
    bent = shares[OWN] - shares["a"] - shares["c"]
    hidden = {**shares, OWN: bent - shares["a"] - shares["c"]}  # adds up, and states a and c truly
    served = fingerprint(bent, SEED)
    why = account_why_not(account(hidden), served, "c", fingerprint(shares["c"], SEED), bounds)
    assert "its own codes have a norm" in why
    unchecked = {**bounds, OWN: None}
    assert account_why_not(account(hidden), served, "c", fingerprint(shares["c"], SEED), unchecked) == ""


def test_a_bent_sum_hidden_in_a_members_share_is_refused_by_that_member():
    shares, bounds = honest()
    bent = shares[OWN] - shares["a"] + shares["c"]  # a's codes flipped
    hidden = {**shares, "a": -shares["a"]}  # a's share stated as flipped: its norm is a's own
    served = fingerprint(bent, SEED)
    assert "misstates the codes we sent" in account_why_not(account(hidden), served, "a",
                                                             fingerprint(shares["a"], SEED), bounds)
    # c cannot tell: what it holds of the round is consistent (a will blame the reducer)
    assert account_why_not(account(hidden), served, "c", fingerprint(shares["c"], SEED), bounds) == ""


def test_an_account_of_other_senders_is_refused():
    shares, bounds = honest()
    served = fingerprint(sum(shares.values()), SEED)
    fewer = account(shares)
    del fewer["a"]
    assert "other senders" in account_why_not(fewer, served, "c", fingerprint(shares["c"], SEED), bounds)


def test_a_malformed_account_is_refused_with_a_reason():
    part = audit.PartAudit(b"g", "c", lambda a, b: torch.zeros(b - a, dtype=torch.int64), {OWN: None, "c": None})
    assert part.why_not(None) == "no account of its sums"
    assert part.why_not({1: b""}) == "no account of its sums"
    assert "malformed account" in part.why_not({OWN: b"short", "c": b"x" * 8 * audit.WIDTH})


def test_share_bounds_hold_each_share_to_its_senders_claims_and_a_reducer_node_to_nothing():
    from p2pdiloco.core.claims import Claims

    def claims_of(*norms):
        return Claims(torch.full((len(norms),), 7), torch.tensor(norms, dtype=torch.float64))
    claims = {"a": claims_of(3.0, 4.0, 12.0, 5.0), "b": claims_of(9.0, 2.0, 2.0, 9.0)}  # c claimed nothing
    start, end = 16384, 3 * 16384  # blocks 1 and 2, plus ½√32768 for rounding

    def expected(*block_norms):
        return sum(x * x for x in block_norms) ** 0.5 * (1 + 1e-4) + 0.5 * (end - start) ** 0.5
    bounds = audit.share_bounds(claims, ["a", "b", "c"], "b", start, end)
    assert set(bounds) == {"a", "c", OWN} and bounds["c"] is None
    assert bounds["a"] == pytest.approx(expected(4.0, 12.0)) and bounds[OWN] == pytest.approx(expected(2.0, 2.0))
    node = audit.share_bounds(claims, ["a", "b", "c"], "node", start, end)
    assert set(node) == {"a", "b", "c", OWN} and node[OWN] == 0.0 and node["b"] == pytest.approx(expected(2.0, 2.0))
    assert audit.share_bounds(claims, ["a", "c"], "c", start, end)[OWN] is None  # a sender with no claims
    assert audit.share_bounds(None, ["a", "b"], "b", start, end) == {"a": None, OWN: None}


def test_fingerprints_are_the_same_only_where_residues_and_sketch_both_agree():
    """Either half alone can miss a change (the residues are one number mod p; the sketch's buckets add values that
    may cancel), so two fingerprints are the same codes only where both halves agree."""
    fp = fingerprint(codes(4), SEED)
    other_sketch, other_residue = fp.clone(), fp.clone()
    other_sketch[audit.RESIDUES] += 1
    other_residue[0] += 1
    assert same(fp, fp.clone()) and same(fp, fp + torch.tensor([audit.MOD] + [0] * audit.BUCKETS))  # mod p
    assert not same(fp, other_sketch) and not same(fp, other_residue)


def test_a_fingerprint_of_any_other_length_or_type_is_refused():
    blob = audit.to_bytes(fingerprint(codes(5), SEED))
    assert torch.equal(audit.from_bytes(blob), fingerprint(codes(5), SEED))
    for bad in (blob + bytes(8), blob[:-8], bytearray(blob), memoryview(blob)):  # each a whole number of int64s
        with pytest.raises(ValueError, match=f"must be {8 * audit.WIDTH} bytes"):
            audit.from_bytes(bad)


def test_a_fingerprint_is_the_same_on_every_peer_and_every_version_of_this_code():
    """A member checks the fingerprints a reducer computed: the draws behind them (each element's residue
    multiplier, bucket and sign, from the piece's seed) are part of the wire, pinned here as test_golden pins the
    codes' bytes. 5,000 codes: whole chunks of the residue's sum and a remainder."""
    fp = fingerprint(codes(0), SEED)
    assert hashlib.sha256(audit.to_bytes(fp)).hexdigest()[:16] == "30d915be7cc3af84"
    assert fp[:3].tolist() == [1946854951, 3, 16]
