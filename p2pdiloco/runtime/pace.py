"""An upload cap for a peer's rounds: a token bucket whose state lives in shared memory, so that the averager
processes a peer forks (one per fragment with --fragments) draw on one budget.

Why a cap helps more than it costs: with P fragments, a round carries 1/P of the model and the next one starts
H/P steps later, so a peer can spread each round's bytes over the time between rounds instead of sending them in a
burst at the link's full speed. The link is then busy at a low, even rate (what a home connection shared with a
household wants), and the rounds still land before the next are due. With P = 1 the same cap stretches the one
round that carries the whole model.

`reserve` is the arithmetic (a virtual clock of when the bytes so far will have left at the capped rate); `spend`
waits for it. Time is CLOCK_MONOTONIC, the same in every process of the machine.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Awaitable, Callable, Optional

BURST_SECONDS = 0.05  # what may go out at once above the rate: a piece of codes at a time, not a round
LOCK_WAIT = 1.0  # seconds; the lock is held for a few arithmetic operations


class UploadPace:
    def __init__(self, bytes_per_s: float, burst_s: float = BURST_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable] = asyncio.sleep):
        if not bytes_per_s > 0:
            raise ValueError(f"an upload cap must be positive, got {bytes_per_s} B/s")
        self.bytes_per_s, self.burst_s = float(bytes_per_s), burst_s
        self._clock, self._sleep = clock, sleep
        # the instant at which every byte reserved so far will have left at the capped rate
        self._drained_at = multiprocessing.Value("d", 0.0)  # shared with the processes forked after us

    def reserve(self, n_bytes: int) -> float:
        """Book `n_bytes` of sending; how many seconds to wait before they may go."""
        lock = self._drained_at.get_lock()
        # a process killed while it held the lock must not stop the others' rounds: they then book unlocked
        locked = lock.acquire(timeout=LOCK_WAIT)
        try:
            now = self._clock()
            start = max(self._drained_at.value, now - self.burst_s)  # an idle link does not bank more than a burst
            self._drained_at.value = start + n_bytes / self.bytes_per_s
            return max(0.0, start - now)
        finally:
            if locked:
                lock.release()

    async def spend(self, n_bytes: int) -> None:
        wait = self.reserve(n_bytes)
        if wait > 0:
            await self._sleep(wait)


def upload_pace(mbit_per_s: Optional[float]) -> Optional[UploadPace]:
    """A peer's cap (--upload-mbps), or None: rounds send at the link's speed."""
    return UploadPace(mbit_per_s * 1e6 / 8) if mbit_per_s else None


async def paced(pace: Optional[UploadPace], n_bytes: int) -> None:
    if pace is not None:
        await pace.spend(n_bytes)
