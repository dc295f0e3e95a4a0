"""How much memory a process tree holds, each physical page counted once however many processes map it, in the
tree or out of it: what the tree would need on a machine of its own.

PSS, the usual measure, splits a shared page among all the processes that map it. Two peers measured side by
side on one machine (scripts/bench/bench_memory.py runs two, so that rounds are real) then each pay half of the
libraries both map, torch's and CUDA's: less than a peer alone needs. The frames come from /proc/PID/pagemap,
for the mappings /proc/PID/smaps says are resident; the kernel shows them to root only."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

PRESENT = np.uint64(1 << 63)
FRAME = np.uint64((1 << 55) - 1)


def pss_bytes(pid: int) -> int:
    """PSS of one process, 0 if it is gone (smaps_rollup: one read, not a walk over every mapping)."""
    return pss_kinds(pid).get("Pss", 0)


def pss_kinds(pid: int) -> dict[str, int]:
    """PSS of one process in bytes, whole ("Pss") and by kind of page ("Pss_Anon": heaps and other private
    memory; "Pss_File": files mapped, libraries and our vectors kept in files); empty if it is gone."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return {}
    return {name: int(rest.split()[0]) * 1024 for name, _, rest in (line.partition(":") for line in lines)
            if name.startswith("Pss")}


def resident_ranges(pid: int) -> Iterator[tuple[int, int]]:
    """(start, end) of every mapping of `pid` with pages in memory."""
    start = end = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms offset dev inode path"
            start, end = (int(x, 16) for x in head.split("-"))
        elif line.startswith("Rss:") and int(line.split()[1]) > 0:
            yield start, end


def frames(pid: int) -> np.ndarray:
    """The physical frames of `pid`'s resident pages (unsorted, may repeat)."""
    found = []
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for start, end in resident_ranges(pid):
            pagemap.seek(start // mmap.PAGESIZE * 8)
            entries = np.frombuffer(pagemap.read((end - start) // mmap.PAGESIZE * 8), dtype="<u8")
            found.append(entries[(entries & PRESENT) != 0] & FRAME)
    out = np.concatenate(found) if found else np.empty(0, dtype=np.uint64)
    if out.size and not out.any():
        raise PermissionError("pagemap shows no frames: reading them needs root (CAP_SYS_ADMIN)")
    return out


def union_bytes(pids: Iterable[int]) -> int:
    """Memory the processes `pids` hold together, each page once; a process gone meanwhile counts nothing."""
    found = []
    for pid in pids:
        try:
            found.append(frames(pid))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return int(np.unique(np.concatenate(found)).size) * mmap.PAGESIZE if found else 0


def pss_by_mapping(pid: int) -> dict[str, dict[str, int]]:
    """PSS of `pid` in bytes per mapped file (anonymous mappings under their kind: "[heap]", "[anon]", ...), with
    how much of it is anonymous: which libraries and which heaps a process's memory is."""
    out: dict[str, dict[str, int]] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split(None, 5)  # a path may hold spaces (and end in " (deleted)")
        head = fields[0]
        if "-" in head and ":" not in head:
            name = fields[5].strip() if len(fields) > 5 else "[anon]"
            out.setdefault(name, {"pss": 0, "anon": 0})
        elif head in ("Pss:", "Anonymous:"):
            out[name]["pss" if head == "Pss:" else "anon"] += int(fields[1]) * 1024
    return out
