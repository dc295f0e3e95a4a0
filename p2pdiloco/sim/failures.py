"""Failure times and learner speeds, drawn once per seed and shared by every mode, so modes are compared on the
very same interruptions. Each learner's failures are a Poisson process of rate chips/MTBI; inter-arrival times
come from one uniform stream per learner, scaled by the rate: a higher failure rate moves the same draws earlier,
which keeps results monotone in the rate for a fixed seed."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from p2pdiloco.sim.lifeline import WorkClock, elastic_spans, restart_spans
from p2pdiloco.sim.params import SimParams
from p2pdiloco.sim.sizes import download_seconds


@dataclass(frozen=True)
class Draws:
    failures: tuple[tuple[float, ...], ...]  # per learner, sorted, within the horizon
    step_seconds: tuple[float, ...]  # per learner


def draw(p: SimParams) -> Draws:
    failures, steps = [], []
    for i in range(p.learners):
        rng = random.Random(f"{p.seed}-learner-{i}")  # str seeds are hashed stably (not PYTHONHASHSEED)
        steps.append(p.step_seconds * (1.0 + p.speed_spread * rng.random()))
        mean_gap = p.mtbi_seconds / p.learner_chips(i)
        times, t = [], 0.0
        while True:
            t += -math.log(1.0 - rng.random()) * mean_gap
            if t >= p.horizon:
                break
            times.append(t)
        failures.append(tuple(times))
    return Draws(tuple(failures), tuple(steps))


def merged_failures(d: Draws) -> list[float]:
    return sorted(t for times in d.failures for t in times)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: the time during which some useful work ran."""
    total, end_so_far = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def learner_clocks(p: SimParams, d: Draws) -> list[WorkClock]:
    """Each learner's spans of work under the failure model it runs (`SimParams.learner_failure`). A restarted
    learner is back after the repair and the download of the state it lacks."""
    down = p.repair_seconds + download_seconds(p)
    clocks = []
    for i, failures in enumerate(d.failures):
        chips, step = p.learner_chips(i), d.step_seconds[i]
        if p.learner_failure == "elastic":
            spans = elastic_spans(failures, chips, p.slice_chips, p.repair_seconds, p.rescale_seconds,
                                  p.upscale_seconds, step, p.horizon)
        else:
            spans = restart_spans(failures, chips, down, step, p.horizon)
        clocks.append(WorkClock(spans))
    return clocks
