"""Consensus and fork distances from published sketches."""

import pytest
import torch

from p2pdiloco.core.consensus import consensus_distance, fork_distance, forked_with, sketch


def test_sketch_distance_estimates_the_state_distance_and_is_zero_for_one_digest():
    """The squared sketch distance is unbiased (a random-sign projection into 64 buckets): over 40 differences
    its mean is within 10 % of the true square and each distance within 40 % of the truth, whatever the
    difference looks like: noise, a constant shift (which sums without signs would blow up 100-fold) or one
    large coordinate."""
    n = 100_000
    theta = torch.randn(n, generator=torch.Generator().manual_seed(0))
    base = sketch(theta)
    ratios = []
    for seed in range(40):
        g = torch.Generator().manual_seed(seed + 1)
        diff = [0.01 * torch.randn(n, generator=g), torch.full((n,), 0.01 * (seed + 1)),
                torch.zeros(n).index_fill_(0, torch.randint(0, n, (1,), generator=g), 3.0)][seed % 3]
        a, b = (5, "aaaa", base), (5, "bbbb", sketch(theta + diff))
        ratios.append(consensus_distance([a, b]) / float(diff.double().norm()))
    assert all(0.6 < r < 1.4 for r in ratios), ratios
    assert sum(r * r for r in ratios) / len(ratios) == pytest.approx(1.0, abs=0.1)
    assert consensus_distance([(5, "aaaa", base), (7, "aaaa", sketch(theta))]) == 0.0


def test_fork_distance_counts_only_forks_we_are_part_of():
    s0, s1, s2 = ([float(i)] * 4 for i in range(3))
    me = (5, "mine", s0)
    # two others' records at one version disagree (say, stale ones of a fork that since healed): not our fork
    stale = [(4, "left", s1), (4, "right", s2)]
    assert fork_distance(me, stale) == 0.0
    assert consensus_distance([me, *stale]) > 0  # still counted by the swarm-wide distance
    # a peer at our version with another digest: a fork we are in; a peer at another version is merely behind
    assert fork_distance(me, [*stale, (5, "theirs", s1)]) == pytest.approx(2.0)
    assert fork_distance(me, [(5, "mine", s0), (6, "ahead", s2)]) == 0.0
    # and who: the chaos test tells a fork with a running peer from one with a dead peer's lingering record
    named = [("left", stale[0]), ("same", (5, "mine", s0)), ("ahead", (6, "ahead", s2)), ("z", (5, "z", s1)),
             ("b", (5, "b", s2)), ("same", (5, "x", s1))]  # a second record of "same" (a restart), forked
    assert forked_with(me, named) == ["b", "same", "z"]


def test_every_element_counts_once_with_a_sign_in_its_bucket_across_chunks():
    """A one-hot vector sketches to ±1 in its bucket (i·k // n) and 0 elsewhere, for elements in the first and in
    a later chunk; signs are ±1, both of them used; each chunk read is told."""
    from p2pdiloco.core import consensus

    n = consensus._CHUNK + 1000
    signs = set()
    for i in (0, 1, n // 2, consensus._CHUNK - 1, consensus._CHUNK, n - 1):
        x = torch.zeros(n)
        x[i] = 1.0
        s = sketch(x)
        bucket = i * len(s) // n
        assert abs(s[bucket]) == 1.0 and sum(abs(v) for v in s) == 1.0, i
        signs.add(s[bucket])
    assert signs == {1.0, -1.0}
    read = []
    sketch(torch.ones(n), let_go=read.append)  # bucket by bucket, each piece once, in order
    assert [(r.start, r.stop) for r in read] == [(i * n // 64 + (i * n % 64 > 0), (i + 1) * n // 64
                                                  + ((i + 1) * n % 64 > 0)) for i in range(64)]
    read = []
    one = sketch(torch.ones(n), k=1, let_go=read.append)  # a bucket longer than the signs' draw: in pieces
    assert read == [slice(0, consensus._CHUNK), slice(consensus._CHUNK, n)]
    assert one == [float(consensus._signs().sum() + consensus._signs()[:1000].sum())]
