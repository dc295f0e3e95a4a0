"""A reducer's account of the sum it served, which every member it served can check.

The sum check (p2pdiloco.core.claims.sum_why_not) bounds a reducer's sum by what its senders could have sent
together; within that bound a hostile reducer could still drop or bend the others' codes. So with each part's sums
a reducer also serves its *account*: for every sender it summed, and for its own codes, a fingerprint of the codes
it summed. A fingerprint is linear, so the fingerprints of a part's shares add up to the fingerprint of its sum.
Every member checks, before it commits:
1. the shares add up to the sum it was served (else the account is not of that sum);
2. its own share is the fingerprint of the codes it sent (else the reducer misstates what it received);
3. every share is within its sender's claims, the reducer's own included: the fingerprint estimates its norm.
A reducer that bends the sum must put the difference into some share. Into a member's: that member sees it (2).
Into its own, or any other: the share's norm gives it away (3) unless the difference is small beside what that
sender claimed, that is, unless the reducer did no more than a sender within its claims can do. What is left is
collusion: a reducer may bend the sum within an accomplice's claims.

A fingerprint of a piece of codes v (p2pdiloco.swarm.codes' unit) under a seed drawn from that piece's served sum:
- a residue, Σ rᵢvᵢ mod p with rᵢ uniform in [0, 2^31) and p = 2^31 − 1: a bent sum passes check 1 with odds of
  about 2^-31 (whatever the difference: one coordinate of it decides, the others fixed);
- a CountSketch of BUCKETS signed bucket sums. Its sum of squares is an unbiased estimate of ‖v‖² (relative spread
  at most √(2/BUCKETS), 0.09), which check 3 holds to SLACK times the bound its sender's claims give.
One random word per element serves both, drawn once per piece for every share of it (`Fingerprints`). A member's
audit of a round (the sums it takes, its own codes again, and the shares of the part it reduces) costs about
22 ns per parameter on one core, beside ~19 for the rest of its codec work (scripts/bench/bench_codec.py, 11 M
parameters, 4 peers).

The seed comes from the piece's served bytes (and the group and place), so it is fixed only once the reducer
has committed to its sum: it cannot pick a difference the fingerprint misses, only try sums until one slips
through, at odds of 2^-31 a try for check 1 (each try a hash of the piece: weeks of one core, against a round's
deadline of seconds), and for check 3 at those of the sketch hiding the difference: 1/(2·BUCKETS) a try for a
difference on two coordinates of a piece (they must share a bucket and its sign), far less for a spread one.

Every number is an exact integer and the random stream is numpy's PCG64, seeded through its SeedSequence (numpy
keeps both stable across releases), so a reducer and its members compute the same fingerprints on any machine. The golden vectors
(tests/golden/) pin them: a change is a wire-format change.

Pure tensor code: no network, no clock.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Mapping, Optional

import numpy as np
import torch

from p2pdiloco.core.claims import Claims
from p2pdiloco.core.exact import BLOCK, n_blocks

MOD = (1 << 31) - 1
RESIDUES = 1
BUCKETS = 256
WIDTH = RESIDUES + BUCKETS  # int64 entries of a fingerprint
SLACK = 2.0  # a share's estimated ‖v‖² may reach this times its bound² (honest: ≤ 1× plus the estimate's spread)
# products of a value and a residue multiplier (< 2^31), summed _CHUNK at a time, must fit int64: values reach
# 2^25 at most (sums of up to 64 codes of 20 bits; a sum beyond its senders' claims is refused before this)
_CHUNK = 64


def zero() -> torch.Tensor:
    return torch.zeros(WIDTH, dtype=torch.int64)


def piece_seed(group: bytes, start: int, served: bytes, left_out) -> int:
    """The seed of one piece's fingerprints: its group, its first element, who its reducer left out and the bytes
    it served, so that the seed exists only once the sum does."""
    h = hashlib.sha256(b"p2pdiloco sum audit\0" + group + start.to_bytes(8, "little"))
    h.update("\0".join(sorted(left_out)).encode() + b"\0")
    h.update(served)
    return int.from_bytes(h.digest()[:16], "little")


class Fingerprints:
    """One piece's random draws, made once for all its shares: a 64-bit word of numpy's PCG64 stream per element,
    whose bits 0-30 are its residue multiplier, 32-39 its sketch bucket and 40 its sketch sign."""

    def __init__(self, seed: int, n: int):
        words = torch.from_numpy(np.random.PCG64(seed).random_raw(n).view(np.int64))
        self.n = n
        # kept narrow, 7 bytes an element instead of 24: a reducer makes these for every piece it sums (drawing
        # 20 pieces in a row peaked 14 MB above the start instead of 27 MB; a node's resident growth in its
        # rounds did not change measurably, docs/internet.md)
        self.multipliers = (words & MOD).to(torch.int32)
        self.buckets = (((words >> 32) & (BUCKETS - 1)) + RESIDUES).to(torch.int16)
        self.signs = (((words >> 40) & 1) * 2 - 1).to(torch.int8)

    def of(self, values: torch.Tensor) -> torch.Tensor:
        """The fingerprint of integer codes (or sums of codes) of the piece (see the module's docstring)."""
        v = values.reshape(-1).to(torch.int64)
        if v.numel() != self.n:
            raise ValueError(f"{v.numel()} values for fingerprints of {self.n}")
        out = zero()
        products = v * self.multipliers  # int64: the narrow draws widen in the product
        whole = self.n - self.n % _CHUNK
        chunks = products[:whole].view(-1, _CHUNK).sum(dim=1).remainder_(MOD)
        out[0] = (int(chunks.sum()) + int(products[whole:].sum())) % MOD
        del products, chunks
        out.index_add_(0, self.buckets.long(), v * self.signs)
        return out


def fingerprint(values: torch.Tensor, seed: int) -> torch.Tensor:
    """The fingerprint of one piece's integer values under `seed`."""
    return Fingerprints(seed, values.numel()).of(values)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fingerprints (sums of fingerprints) are of the same codes: residues mod p, sketches exactly."""
    return bool(((a[:RESIDUES] - b[:RESIDUES]) % MOD == 0).all()) and torch.equal(a[RESIDUES:], b[RESIDUES:])


def norm_squared(fp: torch.Tensor) -> float:
    """The sketch's estimate of ‖v‖²: its buckets' sum of squares."""
    return float(fp[RESIDUES:].double().square().sum())


def to_bytes(fp: torch.Tensor) -> bytes:
    return fp.numpy().astype("<i8").tobytes()


def from_bytes(blob) -> torch.Tensor:
    if not isinstance(blob, bytes) or len(blob) != 8 * WIDTH:
        raise ValueError(f"a fingerprint must be {8 * WIDTH} bytes")
    return torch.from_numpy(np.frombuffer(blob, dtype="<i8").astype(np.int64))


OWN = ""  # the account's key of the reducer's own codes (a reducer node's are zeros: it sends nothing)


def account_why_not(account: Mapping[str, torch.Tensor], served: torch.Tensor, me: Optional[str],
                    mine: torch.Tensor, bounds: Mapping[str, Optional[float]]) -> str:
    """Why a reducer's account of a part does not hold, or "". `account`: share → fingerprint, for exactly the
    keys of `bounds` (the senders it reduced for, and OWN); `served`: the fingerprint of the sums it served us;
    `me`: our key among them (None: we sent it nothing), `mine` the fingerprint of the codes we sent it; `bounds`:
    the norm each share's claims allow (None: unchecked)."""
    if set(account) != set(bounds):
        return "an account of other senders than the part's"
    if not same(sum(account.values(), zero()), served):
        return "an account whose shares do not add up to the sum it served"
    if me is not None and not same(account[me], mine):
        return "an account that misstates the codes we sent it"
    for key, bound in bounds.items():
        if bound is not None and norm_squared(account[key]) > SLACK * bound * bound:
            who = "its own codes" if key == OWN else f"the codes of {key[-6:]}"
            return (f"an account in which {who} have a norm of about {norm_squared(account[key]) ** 0.5:.4g}, "
                    f"beyond the {bound:.4g} their claims allow")
    return ""


def share_bounds(claims: Optional[Mapping[str, Claims]], senders, reducer: str, start: int, end: int) -> dict:
    """The keys a reducer's account of [start, end) must hold, and the norm each share may reach: its sender's
    claimed norms over the part plus what rounding adds (p2pdiloco.core.claims). A reducer that is no sender (a
    reducer node) sums nothing of its own; without claims (none gathered) the norms are not checked."""
    keys = [s for s in senders if s != reducer]
    if not claims:
        return {**dict.fromkeys(keys), OWN: None}
    blocks = slice(start // BLOCK, start // BLOCK + n_blocks(end - start))
    rounding = 0.5 * (end - start) ** 0.5

    def bound(sender: str) -> Optional[float]:
        return claims[sender].norm_over(blocks) + rounding if sender in claims else None
    return {**{s: bound(s) for s in keys}, OWN: bound(reducer) if reducer in senders else 0.0}


class PartAudit:
    """What a member keeps to check one reducer's account of its part: the fingerprints of the sums it was served
    and of the codes it sent there, added up piece by piece as each sum arrives (before it lands over our Δ, while
    our codes of the piece can still be made), and the bound of each share."""

    def __init__(self, group: bytes, me: Optional[str], our_codes: Callable[[int, int], torch.Tensor],
                 bounds: Mapping[str, Optional[float]]):
        self.group, self.me, self.our_codes, self.bounds = group, me, our_codes, dict(bounds)
        self.served, self.mine = zero(), zero()

    def add(self, served: bytes, start: int, end: int, left_out, total: torch.Tensor) -> None:
        draws = Fingerprints(piece_seed(self.group, start, served, left_out), end - start)
        self.served += draws.of(total)
        if self.me is not None and self.me not in left_out:
            self.mine += draws.of(self.our_codes(start, end))

    def why_not(self, blobs) -> str:
        """Why the account a reducer served (share → fingerprint bytes) does not hold, or ""."""
        if not isinstance(blobs, dict) or not all(isinstance(k, str) for k in blobs):
            return "no account of its sums"
        try:
            account = {key: from_bytes(blob) for key, blob in blobs.items()}
        except ValueError as e:
            return f"a malformed account ({e})"
        return account_why_not(account, self.served, self.me, self.mine, self.bounds)
