"""Model-sized fp32 vectors kept in a file mapped shared, resident only while a pass uses them.

`FileVectors` puts `count` vectors of n elements in one unlinked file and maps it shared. A pass over them can
let each chunk go once done (`let_go`): a shared file mapping keeps the data in the file and the kernel's page
cache, which gives the memory back to whoever needs it (writing dirty pages to disk first), so the pass costs
a chunk of resident memory, not the vector. The next use faults the pages back in, from the cache, or from disk
if they were evicted. Letting go is safe at any moment, even while another thread or another process that
shares the mapping reads the pages: they fault back in.

The mapping is torch's own (`UntypedStorage.from_file`) and shared, so a process forked after it (the averager)
inherits the same pages: one buffer for both. Do not hand its tensors to code that calls `share_memory_` under
torch's `file_system` strategy, which copies them into /dev/shm (tests/unit/test_paging.py shows it; hivemind
gets only their shapes, swarm.averager.hivemind_schema).

The file is unlinked as soon as it is open (it goes away with the last process that maps it, even one killed)
and its blocks are reserved at once: a full disk is found now, and the caller keeps the vectors in memory,
saying so, rather than dying of a SIGBUS at a page's first write.
"""

from __future__ import annotations

from typing import Callable

# `let_go(part)`: elements `part` of a vector were read (or written) and this pass needs them no more: where the
# vector lives in a file, their pages may leave this process's memory. The one name for it, everywhere.
LetGo = Callable[[slice], None]


def hold(part: slice) -> None:
    """Nothing to let go: the vector is an ordinary tensor."""

import ctypes
import logging
import mmap
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

FLOAT32 = 4
log = logging.getLogger(__name__)
_MADV_DONTNEED = 4  # linux/mman.h; Python's mmap module offers it only on its own mappings
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class FileVectors:
    """`count` fp32 vectors of n elements in one unlinked file of `folder`, mapped shared; zeros at first."""

    def __init__(self, n: int, count: int, folder: Path, prefix: str):
        if n <= 0 or count <= 0:
            raise ValueError("nothing to map")
        if not hasattr(os, "posix_fallocate"):
            raise OSError("no posix_fallocate (not Linux)")
        folder.mkdir(parents=True, exist_ok=True)
        size = n * count * FLOAT32
        with tempfile.TemporaryFile(dir=folder, prefix=prefix) as f:  # unlinked already
            os.posix_fallocate(f.fileno(), 0, size)  # ENOSPC here, not a SIGBUS at a page's first write
            # the unlinked file reopened through its descriptor: torch maps it shared, and the mapping keeps it
            try:
                storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{f.fileno()}", shared=True, nbytes=size)
            except RuntimeError as e:  # torch's word for a file it cannot open or map: callers expect OSError
                raise OSError(str(e)) from e
        flat = torch.empty(0, dtype=torch.float32).set_(storage.untyped(), 0, (n * count,))
        self.vectors: tuple[torch.Tensor, ...] = tuple(flat.split(n))  # fallocate's blocks read as zeros
        self.address, self.nbytes = flat.data_ptr(), size

    def let_go(self, part: Optional[slice] = None) -> None:
        """Let elements `part` of every vector (or all of them) go from this process's memory."""
        for vector in self.vectors:
            drop_pages(vector if part is None else vector[part])

    def resident_bytes(self) -> Optional[int]:
        """How much of the mapping is in this process's memory now (from /proc/self/smaps; None if unknown)."""
        try:
            lines = Path("/proc/self/smaps").read_text().splitlines()
        except OSError:
            return None
        inside = False
        for line in lines:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                inside = int(head.split("-")[0], 16) == self.address
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
        return None


def drop_pages(view: torch.Tensor) -> None:
    """Drop the whole pages inside a contiguous view of a `FileVectors` vector from this process (the pages at
    its two ends stay: they may hold neighbouring elements still in use). Only for such views: on private
    memory, MADV_DONTNEED would zero the data."""
    start = view.data_ptr()
    end = start + view.numel() * view.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first and _libc.madvise(first, last - first, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")


class PagedStore:
    """Vectors made in files of `folder` (one `FileVectors` each), whose chunks a pass lets go once done; in memory,
    saying so, where the folder cannot hold one. Only views of vectors it made may be let go. The same two calls
    as `core.codec.VectorStore` (that layer sits above this one)."""

    def __init__(self, folder: Path, prefix: str, what: str):
        self.folder, self.prefix, self.what = folder, prefix, what
        self.files: list[FileVectors] = []

    def empty(self, n: int) -> torch.Tensor:
        try:
            self.files.append(FileVectors(n, 1, self.folder, self.prefix))
        except (OSError, ValueError) as e:
            log.warning(f"cannot keep {self.what} in {self.folder} ({e}): it stays in memory ({4 * n / 1e9:.2f} GB)")
            return torch.empty(n)
        return self.files[-1].vectors[0]

    def let_go(self, view: torch.Tensor) -> None:
        if any(_inside(view, f) for f in self.files):  # never a vector of memory: MADV_DONTNEED would zero it
            drop_pages(view)


def _inside(view: torch.Tensor, file: FileVectors) -> bool:
    return file.address <= view.data_ptr() < file.address + file.nbytes


def machine_memory_bytes(cgroup: Path = Path("/sys/fs/cgroup/memory.max")) -> int:
    """The memory this process may use: the machine's, or its container's limit where lower (cgroup v2, mounted at
    /sys/fs/cgroup inside the container; a cgroup v1 limit is not read)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = cgroup.read_text().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical
