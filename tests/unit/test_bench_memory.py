"""How scripts/bench/bench_memory.py reports what a peer would peak at on a machine of its own ("alone")."""

import os

from scripts.bench.bench_memory import PeakSampler

GB = 10**9


def sampler(peak: float, alone_peak, charged_elsewhere: float) -> PeakSampler:
    s = PeakSampler(os.getpid())  # never started: only its figures are set
    s.peak, s.alone_peak, s.charged_elsewhere = int(peak * GB), alone_peak, int(charged_elsewhere * GB)
    return s


def test_a_peak_the_sparse_union_samples_missed_is_the_pss_peak_plus_what_pss_charged_elsewhere():
    # the union (every 2 s at most) saw 1.7 GB; PSS peaked at 1.8 GB and charged up to 0.1 GB to the other peer
    assert sampler(1.8, int(1.7 * GB), 0.1).alone_gb == 1.9


def test_a_measured_union_above_that_estimate_is_reported_as_measured():
    assert sampler(1.8, int(2.05 * GB), 0.1).alone_gb == 2.05


def test_without_root_there_is_no_alone_figure():
    assert sampler(1.8, None, 0.0).alone_gb is None
