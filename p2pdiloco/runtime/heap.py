"""Hand the C heap's free pages back to the kernel after a round's passes and at its end.

glibc keeps what a process frees. After the first large block it maps and frees, it raises its mmap threshold
(up to 32 MB), so later gradients, activations and a round's chunk temporaries come from its heaps, one per
thread that allocates, and stay resident there once freed. A round's passes, run by the merger's thread while
the inner steps go on, left such holes each time: +0.3 GB in the training process for `large` at the buffer's
load, kept to the round's end, and the next round's on top (docs/hardware.md). A fixed low threshold stops that,
but maps and zeroes every step's tensors afresh (a quarter of the throughput). `malloc_trim(0)` instead gives
back every whole free page of every heap, at once (under 0.1 s here): called after a pass, not after every
step, what the next pass faults back in costs little.

Elsewhere than glibc (musl, macOS) there is no such call, and nothing is done.
"""

from __future__ import annotations

import ctypes
from typing import Optional

# the C library this process already runs on (as runtime.paging does): no search for it, which would start
# /sbin/ldconfig in every process that imports this
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
if _malloc_trim is not None:
    _malloc_trim.argtypes, _malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int


def give_back_free_heap() -> Optional[bool]:
    """Return the heaps' free pages to the kernel; True if any went back, None where the C library cannot."""
    if _malloc_trim is None:
        return None
    return bool(_malloc_trim(0))
