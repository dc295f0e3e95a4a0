"""The benchmarks' CPU figures: which sampling intervals a window takes, and a busy process seen as busy."""

import os
import subprocess
import sys
import time

from p2pdiloco.ops.cpuload import HZ, CpuSampler, Sample, cpu_during


def sample(t: float, busy: int, softirq: int, **ticks) -> Sample:
    return Sample(time=t, busy=busy, total=200 * t, softirq=softirq,
                  ticks={(i, 0): (name, n) for i, (name, n) in enumerate(ticks.items())})


def test_only_intervals_inside_a_window_count():
    samples = [sample(0, 0, 0, a=0), sample(1, 200, 100, a=HZ), sample(2, 250, 100, a=HZ), sample(3, 450, 100, a=2 * HZ)]
    # host: 200 ticks a second in all; intervals 0-1 and 2-3 are all busy, 1-2 a quarter
    both = cpu_during(samples, [(0.2, 0.8), (2.1, 2.9)])
    assert both["seconds"] == 2 and both["busy"] == 1.0 and both["softirq"] == 0.25
    assert both["cores"] == {"a": 1.0}
    middle = cpu_during(samples, [(1.4, 1.6)])
    assert middle["busy"] == 0.25 and middle["cores"] == {"a": 0.0}
    assert cpu_during(samples, [(5, 6)]) == {}


def test_a_process_that_starts_between_samples_counts_from_zero():
    first = sample(0, 0, 0)
    later = Sample(time=1, busy=100, total=200, softirq=0, ticks={(7, 5): ("new", HZ // 2)})
    assert cpu_during([first, later], [(0, 1)])["cores"] == {"new": 0.5}


def test_a_spinning_process_is_seen_using_about_a_core():
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 2.5\nwhile time.time() < end: pass"])
    try:
        with CpuSampler(lambda p, _: "spinner" if p.pid == spinner.pid else None, interval=0.2) as cpu:
            start = time.time()
            spinner.wait(10)
        figures = cpu.during([(start + 0.5, start + 2.2)])
    finally:
        spinner.kill()
    assert 0.4 <= figures["cores"]["spinner"] <= 1.1, figures  # one core at most; on 2 loaded cores, maybe less
    assert figures["busy"] * os.cpu_count() >= figures["cores"]["spinner"] - 0.1, figures  # the host saw it too
