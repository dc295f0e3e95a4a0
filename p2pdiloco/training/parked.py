"""Where Θ and the outer momentum live: in memory, or parked in a file and paged in only while used.

Between rounds nothing reads Θ or the outer momentum (8 bytes per parameter): the inner steps touch θ and the
inner optimizer only. Θ is read when a contribution is made (Δ = Θ − θ), when a round's outcome is applied,
by an evaluation, a checkpoint, a state served to a joiner; the momentum only by the outer step, the digest and
those last two. `Parked` keeps both in one file mapped shared, and `page_out` drops its pages from the
process once a use is over: the data stays in the file and the kernel's page cache, which gives the memory
back to whoever needs it (writing dirty pages to disk first), so a peer's resident memory is that of the inner
loop. The next use faults the pages back in, from the cache, or from disk if they were evicted.

What it costs: each round rewrites all of Θ and the momentum, so the kernel writes 8 bytes per parameter to
disk per round (2 per round for checkpoints every 5 rounds, by comparison); reading them back from disk,
where the cache lost them, takes about a second per GB. The file is unlinked as soon as it is open (it goes
away with the process, even one killed) and its blocks are reserved at once: a full disk is found now, and
the peer keeps the vectors in memory, saying so, rather than dying of a SIGBUS at the first write.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

FLOAT32 = 4


class Held:
    """Θ and the momentum as two ordinary tensors."""

    def __init__(self, n: int):
        self.theta, self.momentum = torch.empty(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)

    def page_out(self, part: Optional[slice] = None) -> None:
        pass


class Parked:
    """Θ and the momentum in one unlinked file of `folder`, mapped shared."""

    def __init__(self, n: int, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        size = 2 * n * FLOAT32
        with tempfile.TemporaryFile(dir=folder, prefix="global-state-") as f:  # unlinked already
            os.posix_fallocate(f.fileno(), 0, size)  # ENOSPC here, not a SIGBUS at a page's first write
            self._map = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)  # the mapping keeps the file
        # fallocate's blocks read as zeros: the momentum starts at 0, Θ is written by the caller
        self.theta = torch.frombuffer(self._map, dtype=torch.float32, count=n)
        self.momentum = torch.frombuffer(self._map, dtype=torch.float32, count=n, offset=n * FLOAT32)

    def page_out(self, part: Optional[slice] = None) -> None:
        """Drop the pages (of elements `part` of both vectors, or all) from this process: a shared file mapping
        keeps their data in the file and the page cache, so this is safe at any moment, even while another
        thread reads them (it faults them back). A long pass (the outer step, a rebase) pages out as it goes,
        so Θ and the momentum are never all in memory at once."""
        if part is None:
            self._map.madvise(mmap.MADV_DONTNEED)
            return
        for base in (0, self.theta.numel() * FLOAT32):  # Θ, then the momentum
            start = -(-(base + part.start * FLOAT32) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside only
            stop = (base + part.stop * FLOAT32) // mmap.PAGESIZE * mmap.PAGESIZE
            if stop > start:
                self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def resident_bytes(self) -> Optional[int]:
        """How much of the mapping is in this process's memory now (from /proc/self/smaps; None if unknown)."""
        start = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        try:
            lines = Path("/proc/self/smaps").read_text().splitlines()
        except OSError:
            return None
        inside = False
        for line in lines:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                low = int(head.split("-")[0], 16)
                inside = low == start
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
        return None


def global_vectors(n: int, folder: Optional[Path]) -> Held | Parked:
    """Parked in `folder` if given and it can hold them; in memory otherwise (with a warning if it cannot)."""
    if folder is None:
        return Held(n)
    try:
        return Parked(n, folder)
    except (OSError, ValueError, AttributeError) as e:  # AttributeError: no posix_fallocate or madvise (not Linux)
        log.warning("cannot park the global state in %s (%s): it stays in memory (%.2f GB)", folder, e,
                    2 * n * FLOAT32 / 1e9)
        return Held(n)
