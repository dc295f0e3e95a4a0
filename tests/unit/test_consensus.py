"""Consensus and fork distances from published sketches."""

import pytest
import torch

from p2pdiloco.core.consensus import consensus_distance, fork_distance, sketch


def test_sketch_distance_estimates_the_state_distance_and_is_zero_for_one_digest():
    theta = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    other = theta + 0.01 * torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    a, b = (5, "aaaa", sketch(theta)), (5, "bbbb", sketch(other))
    true = float((theta - other).norm())
    assert consensus_distance([a, b]) == pytest.approx(true, rel=0.5)
    assert consensus_distance([a, (7, "aaaa", sketch(theta))]) == 0.0


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
