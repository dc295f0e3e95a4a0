"""What failures leave of a learner's time: the spans in which it runs inner steps, under each failure model.

They are drawn before any round is simulated, because a failure's effect on a learner's compute does not depend on
the protocol: the protocol decides only which of that work is merged. The two models (docs/simulator.md):
- `elastic`, the paper's: a chip failure stalls the learner (`rescale_seconds`), which trains on without the
  failed slice until it returns (`repair_seconds` later) and stalls again to take it back (`upscale_seconds`).
  Nothing is lost but the step in progress. Elastic data-parallel is one such learner of every chip.
- `restart`, a p2pdiloco peer's: the process dies (`died`), and is back after the repair and the state download.
  What it loses is for the driver to say: the work since its last local checkpoint.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Span:
    start: float
    end: float
    chips: int
    died: bool = False  # the process died at `end` (restart): it is back at the next span's start


def _whole_steps(start: float, end: float, step: float) -> float:
    """A failure loses the step in progress."""
    run = end - start
    return start + run - math.fmod(run, step)


def restart_spans(failures: Sequence[float], chips: int, down: float, step: float, horizon: float) -> list[Span]:
    """Up from 0; each failure kills the process, which is back `down` later. Failures while it is down are
    handled by the restart under way."""
    spans, t = [], 0.0
    for f in failures:
        if f < t:
            continue
        end = _whole_steps(t, f, step)
        if end > t:
            spans.append(Span(t, end, chips, died=True))
        else:
            spans.append(Span(t, t, chips, died=True))  # it died before finishing a step: still a death
        t = f + down
    if t < horizon:
        spans.append(Span(t, horizon, chips))
    return spans


def elastic_spans(failures: Sequence[float], chips: int, slice_chips: int, repair: float, downscale: float,
                  upscale: float, step: float, horizon: float) -> list[Span]:
    """Each failure takes a slice out until it is repaired; every change of chips stalls the learner (a failure's
    downscale, a return's upscale). A change during a stall is taken by that stall."""
    spans: list[Span] = []
    returns: list[float] = []
    out, stall_end, k = 0, 0.0, 0  # slices out; the running span began at stall_end
    while True:
        fail = failures[k] if k < len(failures) else math.inf
        back = returns[0] if returns else math.inf
        t, is_failure = min((fail, True), (back, False))
        if t >= horizon:
            break
        running = max(0, chips - slice_chips * out)
        if is_failure:
            k += 1
            out += 1
            heapq.heappush(returns, t + repair)
        else:
            heapq.heappop(returns)
            out -= 1
        if t < stall_end:
            continue  # taken by the stall under way
        end = _whole_steps(stall_end, t, step) if is_failure else t
        if end > stall_end and running:
            spans.append(Span(stall_end, end, running))
        stall_end = t + (downscale if is_failure else upscale)
    running = max(0, chips - slice_chips * out)
    if stall_end < horizon and running:
        spans.append(Span(stall_end, horizon, running))
    return spans


class WorkClock:
    """A learner's spans as a clock of work: how much it has trained by a time, and when it will have trained so
    much more. Times are wall (simulated) seconds; work is seconds of inner steps."""

    def __init__(self, spans: Sequence[Span]):
        self.spans = list(spans)
        self.starts = [s.start for s in self.spans]
        self.work_before, self.chips_before = [0.0], [0.0]
        for s in self.spans:
            self.work_before.append(self.work_before[-1] + (s.end - s.start))
            self.chips_before.append(self.chips_before[-1] + s.chips * (s.end - s.start))

    def _span(self, t: float) -> int:
        """The last span that starts at or before t (-1: none)."""
        return bisect.bisect_right(self.starts, t) - 1

    def work_at(self, t: float) -> float:
        i = self._span(t)
        if i < 0:
            return 0.0
        s = self.spans[i]
        return self.work_before[i] + min(max(t - s.start, 0.0), s.end - s.start)

    def chip_seconds(self, a: float, b: float) -> float:
        return max(0.0, self._chips_at(b) - self._chips_at(a))

    def _chips_at(self, t: float) -> float:
        i = self._span(t)
        if i < 0:
            return 0.0
        s = self.spans[i]
        return self.chips_before[i] + s.chips * min(max(t - s.start, 0.0), s.end - s.start)

    def wall_after(self, t: float, seconds: float) -> float:
        """When `seconds` more of work are done, from t on (inf: not within the spans)."""
        target = self.work_at(t) + seconds
        i = bisect.bisect_left(self.work_before, target, lo=1) - 1  # the span in which the work reaches target
        if i >= len(self.spans):
            return math.inf
        s = self.spans[i]
        return max(t, s.start + (target - self.work_before[i]))

    def pieces(self, a: float, b: float) -> list[tuple[float, float]]:
        """The parts of [a, b) in which the learner worked (its stalls and outages left out)."""
        out, i = [], max(0, self._span(a))
        while i < len(self.spans) and self.spans[i].start < b:
            s = self.spans[i]
            lo, hi = max(a, s.start), min(b, s.end)
            if hi > lo:
                out.append((lo, hi))
            i += 1
        return out

    def death_in(self, a: float, b: float) -> Optional[Span]:
        """The first span that dies within (a, b], if any."""
        i = max(0, self._span(a))
        while i < len(self.spans) and self.spans[i].start <= b:
            s = self.spans[i]
            if s.died and a < s.end <= b:
                return s
            i += 1
        return None

    def next_start(self, t: float) -> float:
        """The start of the first span after t (inf: none)."""
        i = bisect.bisect_right(self.starts, t)
        return self.starts[i] if i < len(self.starts) else math.inf


def checkpoint_before(span: Span, t: float, every: float) -> float:
    """The newest local checkpoint of a learner up since span.start, at time t: written every `every` seconds of
    its life (0: never)."""
    if every <= 0:
        return -math.inf
    return span.start + math.floor((t - span.start) / every) * every


def clip(intervals: Sequence[tuple[float, float]], until: float) -> list[tuple[float, float]]:
    """The parts of the intervals up to `until`: the work a checkpoint at `until` holds."""
    return [(a, min(b, until)) for a, b in intervals if a < until]
