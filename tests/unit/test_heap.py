"""runtime.heap: what a process freed into glibc's heap goes back to the kernel when asked, and only then."""

import textwrap

import pytest

from p2pdiloco.runtime import heap
from tests.harness.memory import fresh_python

# A fresh process (its allocator settings are its own): 200 blocks of 1 MB from the heap (a high mmap threshold,
# as glibc sets itself after the first large free), written, then every block but the last freed. The last keeps
# the heap's top in use, so free() itself cannot shrink the heap; what is free stays resident until a trim.
PROGRAM = textwrap.dedent("""
    import ctypes, sys
    from p2pdiloco.runtime.heap import give_back_free_heap
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 64 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)

    def anonymous():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) << 10

    blocks = [libc.malloc(1 << 20) for _ in range(200)]
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks[:-1]:
        libc.free(b)
    before = anonymous()
    said = give_back_free_heap() if sys.argv[1] == "trim" else None
    print(before - anonymous(), said)
""")


def _freed(mode: str) -> tuple[int, str]:
    given_back, said = fresh_python(PROGRAM, mode).split()
    return int(given_back), said


@pytest.mark.skipif(heap._malloc_trim is None, reason="not glibc: no malloc_trim")
def test_free_heap_goes_back_only_when_asked():
    kept, _ = _freed("keep")
    given_back, said = _freed("trim")
    assert kept < 20 << 20, kept  # free() alone kept the 199 MB resident: what a round's holes do
    assert given_back > 150 << 20, given_back
    assert said == "True"


def test_without_malloc_trim_nothing_is_done(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", None)
    assert heap.give_back_free_heap() is None
