"""One global state fetched from several donors at once, in parts, resuming where a dying donor left off.

No networking here: the transport is an injected coroutine `fetch_part(donor, start, length)` returning
(donor's state metadata, a flat fp32 tensor of `length` elements). Every donor serves the same state (the
caller picks donors holding one state key), so any part can come from any donor. Each donor works through a
shared queue of parts, several at a time (each part is a stream of its own); a part whose donor fails or stalls
goes back on the queue for the others, and parts already received are kept. The caller verifies the assembled
state against the key's digest.
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
# Parts in flight from one donor. Over a 100 ms round trip one libp2p stream carries about 61 Mbit/s (its flow
# control window), four streams 86 (100 Mbit/s testbed link, docs/bandwidth.md). A donor holds no more bytes of
# parts in flight than with one stream: parts are that much smaller (`part_size`).
STREAMS_PER_DONOR = 4


class TransferError(RuntimeError):
    pass


@dataclass
class Transfer:
    metadata: dict
    flat: torch.Tensor
    parts_by_donor: Counter = field(default_factory=Counter)
    failed_donors: dict[str, str] = field(default_factory=dict)  # donor -> why it stopped serving
    requeued_parts: int = 0  # parts a failing donor had taken and another donor served instead


def part_size(total: int, n_donors: int, parts_per_stream: int = 4, streams: int = STREAMS_PER_DONOR) -> int:
    """A few parts per stream, so that a donor dying costs only its parts in flight, and at most MAX_PART over
    the streams of one donor."""
    most = max(MIN_PART, MAX_PART // streams)
    return min(most, max(MIN_PART, math.ceil(total / max(1, n_donors * streams * parts_per_stream))))


async def fetch_parts(donors: list[str], key: tuple[int, str], total: int, fetch_part: FetchPart,
                      part_timeout: float, size: int | None = None, streams: int = STREAMS_PER_DONOR) -> Transfer:
    """`key`: the (version, digest) the donors announced; a part of any other state is refused. `streams`: parts
    in flight from each donor; once one of them fails, the donor is given no more."""
    size = size or part_size(total, len(donors), streams=streams)
    queue: asyncio.Queue = asyncio.Queue()
    for start in range(0, total, size):
        queue.put_nowait((start, min(size, total - start)))
    received: dict[int, torch.Tensor] = {}
    result = Transfer(metadata={}, flat=torch.empty(0))
    key = tuple(key)

    def complete() -> bool:
        return sum(c.numel() for c in received.values()) >= total

    async def work(donor: str) -> None:
        while donor not in result.failed_donors and (start_length := await _next(queue, complete)) is not None:
            start, length = start_length
            if donor in result.failed_donors:  # failed on another stream while this one waited for a part
                queue.put_nowait(start_length)
                return
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

    await asyncio.gather(*(work(d) for d in donors for _ in range(max(1, streams))))
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
