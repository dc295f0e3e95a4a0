"""A process tree's memory with each page counted once, where PSS charges a shared page in part to processes
outside the tree (scripts/bench_memory.py's "alone" figure)."""

import mmap
import os

import pytest

from p2pdiloco.ops.residency import pss_bytes, union_bytes

MB = 1 << 20
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the kernel shows physical frames to root only")


def test_pages_shared_with_a_process_outside_the_tree_count_in_full_where_pss_charges_half():
    shared = mmap.mmap(-1, 64 * MB, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    shared.write(b"x" * (64 * MB))  # resident in us
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:  # touches every page of the shared mapping, says so, waits to be told to go
        try:
            bytes(shared[:: mmap.PAGESIZE])
            os.write(ready_w, b"1")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        alone_child, alone_us, together = union_bytes([child]), union_bytes([os.getpid()]), union_bytes(
            [os.getpid(), child])
        # PSS gives the child half of the 64 MB it shares with us; alone it would need all of them
        assert alone_child - pss_bytes(child) >= 30 * MB, (alone_child, pss_bytes(child))
        # within the tree, a shared page counts once: the two together hold at most one copy of the mapping
        assert together <= alone_us + alone_child - 60 * MB, (together, alone_us, alone_child)
        assert together >= alone_us >= 64 * MB
    finally:
        os.write(done_w, b"1")
        os.waitpid(child, 0)


def test_a_process_gone_counts_nothing():
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    assert union_bytes([child]) == 0
