"""Memory a process frees goes back to the system at once: for the averager, whose rounds allocate and free
a model's worth of ~1 MB messages (packed codes, sums) from two threads.

glibc's malloc raises its mmap threshold to the size of each mapped block freed (up to 32 MB), so after the
first round those messages come from its heaps instead, where fragmentation keeps them: the averager of a
100M-parameter peer grew from 0.2 to 1.0 GB over its first rounds and stayed there (an H200 run,
docs/hardware.md). A fixed threshold gives every allocation over it a mapping of its own, unmapped when freed.
Not for the training process: its step's tensors would then be faulted in anew each step (tried: 30 % slower).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_large_frees(threshold: int = 1 << 17) -> bool:
    """Allocations of `threshold` bytes or more each get their own mapping from now on, given back when freed.
    False where the C library is not glibc (the setting does not exist there; nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
