"""A process tree's memory with each page counted once, where PSS charges a shared page in part to processes
outside the tree (scripts/bench/bench_memory.py's "alone" figure), and a process's memory by mapping
(scripts/probes/cuda_floor.py's largest mappings)."""

import mmap
import os

import pytest

from p2pdiloco.ops.residency import pss_by_mapping, pss_bytes, union_bytes

MB = 1 << 20
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="the kernel shows physical frames to root only")


@ROOT
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


@ROOT
def test_a_process_gone_counts_nothing():
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    assert union_bytes([child]) == 0


def test_memory_by_mapping_names_the_file_a_page_comes_from_and_counts_private_pages_as_anonymous(tmp_path):
    path = tmp_path / "vector.bin"
    path.write_bytes(b"\1" * (16 * MB))
    before = pss_by_mapping(os.getpid())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        private = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        private.write(b"x" * (16 * MB))  # resident, and ours alone
        bytes(mapped[:: mmap.PAGESIZE])
        after = pss_by_mapping(os.getpid())
        private.close()
    mine = after[str(path)]
    assert mine["pss"] >= 15 * MB and mine["anon"] == 0, mine
    anon_growth = sum(v["anon"] for v in after.values()) - sum(v["anon"] for v in before.values())
    assert anon_growth >= 15 * MB, anon_growth
