"""One global state fetched from several donors at once, in parts, resuming where a dying donor left off.

No networking here: the transport is an injected coroutine `fetch_part(donor, start, length)` returning
(donor's state metadata, a flat fp32 tensor of `length` elements). Every donor serves the same state (the
caller picks donors holding one state key), so any part can come from any donor. Each donor works through a
shared queue of parts; a part whose donor fails or stalls goes back on the queue for the others, and parts
already received are kept. The caller verifies the assembled state against the key's digest.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

FetchPart = Callable[[str, int, int], Awaitable[tuple[dict, torch.Tensor]]]
MIN_PART, MAX_PART = 1 << 16, 1 << 22  # elements: 256 KiB .. 16 MiB of fp32


class TransferError(RuntimeError):
    pass


@dataclass
class Transfer:
    metadata: dict
    flat: torch.Tensor
    parts_by_donor: Counter = field(default_factory=Counter)
    failed_donors: dict[str, str] = field(default_factory=dict)  # donor -> why it stopped serving
    requeued_parts: int = 0  # parts a failing donor had taken and another donor served instead


def part_size(total: int, n_donors: int, parts_per_donor: int = 4) -> int:
    """A few parts per donor, so that a donor dying costs only its part in flight."""
    return min(MAX_PART, max(MIN_PART, math.ceil(total / max(1, n_donors * parts_per_donor))))


async def fetch_parts(donors: list[str], key: tuple[int, str], total: int, fetch_part: FetchPart,
                      part_timeout: float, size: int | None = None) -> Transfer:
    """`key`: the (version, digest) the donors announced; a part of any other state is refused."""
    size = size or part_size(total, len(donors))
    queue: asyncio.Queue = asyncio.Queue()
    for start in range(0, total, size):
        queue.put_nowait((start, min(size, total - start)))
    received: dict[int, torch.Tensor] = {}
    result = Transfer(metadata={}, flat=torch.empty(0))
    key = tuple(key)

    def complete() -> bool:
        return sum(c.numel() for c in received.values()) >= total

    async def work(donor: str) -> None:
        while (start_length := await _next(queue, complete)) is not None:
            start, length = start_length
            try:
                metadata, chunk = await asyncio.wait_for(fetch_part(donor, start, length), part_timeout)
                chunk_key = (metadata.get("version"), metadata.get("digest"))
                if chunk_key != key:
                    raise TransferError(f"served state {chunk_key}, not {key}")
                if chunk.dtype != torch.float32 or chunk.shape != (length,):
                    raise TransferError(f"part of shape {tuple(chunk.shape)} {chunk.dtype}, not ({length},)")
            except Exception as e:  # dead, frozen, moved on or hostile: its part goes to the others
                queue.put_nowait((start, length))
                result.requeued_parts += 1
                result.failed_donors[donor] = f"{type(e).__name__}: {e}"
                return
            result.metadata = result.metadata or metadata
            received[start] = chunk
            result.parts_by_donor[donor] += 1

    await asyncio.gather(*(work(d) for d in donors))
    missing = total - sum(c.numel() for c in received.values())
    if missing:
        raise TransferError(f"{missing} of {total} elements missing: every donor failed ({result.failed_donors})")
    result.flat = torch.cat([received[s] for s in sorted(received)])
    return result


async def _next(queue: asyncio.Queue, complete: Callable[[], bool]):
    """The next part to fetch; while other donors hold the last parts, wait: they may hand them back."""
    while not complete():
        try:
            return queue.get_nowait()
        except asyncio.QueueEmpty:
            await asyncio.sleep(0.05)
    return None
