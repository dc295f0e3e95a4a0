"""The upload cap (--upload-mbps): its arithmetic on a clock we move, and one budget across forked processes."""

import asyncio
import multiprocessing
import time

import pytest

from p2pdiloco.config import ConfigError, SwarmConfig
from p2pdiloco.runtime.pace import UploadPace, upload_pace


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_bytes_booked_at_once_go_out_at_the_capped_rate_after_one_burst():
    clock = Clock()
    pace = UploadPace(1000.0, burst_s=0.05, clock=clock)
    waits = [pace.reserve(100) for _ in range(5)]  # 100 B each at 1000 B/s: 0.1 s each, the first 0.05 s banked
    assert waits == pytest.approx([0.0, 0.05, 0.15, 0.25, 0.35])
    clock.now += 10.0  # an idle link banks no more than the burst
    assert pace.reserve(100) == 0.0 and pace.reserve(100) == pytest.approx(0.05)


def test_in_any_window_what_was_sent_is_at_most_the_rate_times_the_window_plus_a_burst_and_a_piece():
    clock, sent = Clock(), []
    pace = UploadPace(10_000.0, burst_s=0.05, clock=clock)
    for size in [3000, 500, 7000, 100, 4000, 2500] * 5:
        sent.append((clock.now + pace.reserve(size), size))  # each goes out when its wait is over
        clock.now += 0.03  # the sender comes back for more before the link is free
    for i, (start, _) in enumerate(sent):
        for end, _ in sent[i:]:
            window = sum(size for t, size in sent if start <= t <= end)
            assert window <= 10_000.0 * (end - start + 0.05) + 7000 + 1e-6


def test_processes_forked_after_the_cap_is_made_draw_on_one_budget():
    pace = UploadPace(1000.0, burst_s=0.0)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=pace.reserve, args=(5000,))  # 5 s of sending, booked in another process
    started = time.monotonic()
    child.start()
    child.join(30)
    assert child.exitcode == 0
    wait = pace.reserve(1)  # what the child booked, less the time since it booked it (a loaded machine's fork)
    assert 5.0 - (time.monotonic() - started) <= wait <= 5.0 and wait > 0


def test_spend_waits_what_reserve_says():
    waited = []

    async def sleep(seconds):
        waited.append(seconds)

    pace = UploadPace(1000.0, burst_s=0.0, clock=Clock(), sleep=sleep)
    asyncio.run(pace.spend(500))
    asyncio.run(pace.spend(500))
    assert waited == pytest.approx([0.5])


def test_the_cap_is_optional_and_a_bad_one_is_one_line():
    assert upload_pace(None) is None and upload_pace(8.0).bytes_per_s == 1e6
    assert SwarmConfig(upload_mbps=2.0).link_mbps == 2.0 and SwarmConfig().link_mbps == 100.0
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="upload mbps must be a positive number"):
            SwarmConfig(upload_mbps=bad)


def test_every_averager_a_peer_starts_gets_its_one_cap():
    from p2pdiloco.config import OuterConfig
    from p2pdiloco.swarm.wiring import merge_settings, start_averager

    made = []

    class Averager:
        def __init__(self, *args, **kwargs):
            made.append(kwargs["pace"])

        def run_in_background(self, await_ready):
            pass

    cfg = SwarmConfig(upload_mbps=4.0)
    pace = upload_pace(cfg.upload_mbps)
    for size in (1000, 2000):  # two fragments' averagers
        settings = merge_settings(cfg, OuterConfig(), size, [], 10, "peer", pace)
        start_averager(settings, None, lambda: ({}, []), None, Averager)
        assert settings.limits == merge_settings(SwarmConfig(bandwidth_mbps=4.0), OuterConfig(), size, [], 10,
                                                 "peer").limits  # deadlines assume the capped link
    assert made == [pace, pace] and pace.bytes_per_s == 500_000
