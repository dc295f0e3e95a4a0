"""Where a contribution's Δ waits while its round runs, and after it: 4 bytes per parameter that nothing needs
in memory most of the time. The merger copies Δ into its averaging buffer when an island forms (and again only if
that island fails and another is tried); the peer needs it again when the outcome is applied (θ_S = Θ_S − Δ), and
fork recovery needs the last merged Δ only if a state we adopt later lacks that merge, which is rare.

`InMemory` keeps the tensor (tests, and where no folder is given). `OnDisk` writes each Δ to a file and lets the
tensor go once written: `put` in a background thread, `put_parts` as Δ is made, a parameter at a time, so it is
never whole in memory. While a round runs, its Δ is then held only by the averaging buffer, not by the trainer
too. It is read back a slice at a time (`Kept.parts`, `FileParts`): into the buffer for each island tried, by
error feedback, and when the outcome is applied; only fork recovery and RDA read it whole (`get`). Two files at
most (the last merge's and the round in flight's), overwritten as rounds go; a write that fails (a full disk)
keeps that Δ in memory and says so once.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from p2pdiloco.protocol.outcomes import Kept

PartsMaker = Callable[[], Iterator[torch.Tensor]]  # Δ's consecutive pieces, afresh at each call

log = logging.getLogger(__name__)


def assemble(make_parts: PartsMaker, numel: int) -> torch.Tensor:
    out, at = torch.empty(numel, dtype=torch.float32), 0
    for piece in make_parts():
        out[at:at + piece.numel()] = piece
        at += piece.numel()
    return out


class InMemory:
    def put(self, delta: torch.Tensor) -> Kept:
        return Kept(delta)

    def put_parts(self, make_parts: PartsMaker, numel: int) -> Kept:
        return Kept(assemble(make_parts, numel))

    def close(self) -> None:
        pass


class OnDisk:
    SLOTS = 2  # the last merge's Δ and the round in flight's: never more at once

    def __init__(self, folder: Path):
        self.folder = folder
        self._free = list(range(self.SLOTS))
        self._lock = threading.Lock()
        self._warned = self._closed = False
        # one thread does every write, read-back and unlink, in order: a slot is never written while an
        # earlier write or removal of the same file is still under way
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spill")

    def _take_slot(self) -> Optional[int]:
        with self._lock:
            return self._free.pop(0) if self._free and not self._closed else None

    def put(self, delta: torch.Tensor) -> Kept:
        slot = self._take_slot()
        if slot is None:  # a caller holding more than SLOTS at once: keep it in memory rather than overwrite one
            return Kept(delta)
        return _Spilled(self, slot, delta.numel(), delta)

    def put_parts(self, make_parts: PartsMaker, numel: int) -> Kept:
        """Δ written as it is made, a piece at a time, in the caller's thread: it is never whole in memory. A
        write that fails keeps it in memory (made again from the start), as `put` does."""
        slot = self._take_slot()
        if slot is None:
            return Kept(assemble(make_parts, numel))
        self._io.submit(lambda: None).result()  # the removal of this slot's last file is done: ours is not touched
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.path(slot), "wb") as f:
                for piece in make_parts():
                    f.write(memoryview(piece.detach().contiguous().numpy()).cast("B"))
        except OSError as e:
            self.warn(e)
            self.release(slot)
            return Kept(assemble(make_parts, numel))
        return _Spilled(self, slot, numel)

    def path(self, slot: int) -> Path:
        return self.folder / f"delta-{slot}.f32"

    def release(self, slot: int) -> None:
        with self._lock:
            if self._closed:
                return  # close() removed every file
            self._io.submit(self.path(slot).unlink, missing_ok=True)
            self._free.append(slot)

    def warn(self, error: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("could not write a contribution to %s (%s): fork recovery keeps it in memory",
                        self.folder, error)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in range(self.SLOTS):
                self._io.submit(self.path(slot).unlink, missing_ok=True)
        self._io.shutdown(wait=True)


class _Spilled(Kept):
    """A Δ on its way to, or in, a file: memory holds it only until the write completes (or if it failed). Without
    `delta`, the caller wrote the file already (`OnDisk.put_parts`)."""

    def __init__(self, store: OnDisk, slot: int, numel: int, delta: Optional[torch.Tensor] = None):
        super().__init__(delta)
        self.store, self.slot, self.numel = store, slot, numel
        if delta is None:
            self._written = Future()
            self._written.set_result(None)
        else:
            self._written = store._io.submit(self._write, delta)

    def _write(self, delta: torch.Tensor) -> None:
        try:
            self.store.folder.mkdir(parents=True, exist_ok=True)
            with open(self.store.path(self.slot), "wb") as f:
                f.write(memoryview(delta.detach().contiguous().numpy()).cast("B"))  # the GIL is let go meanwhile
        except OSError as e:
            self.store.warn(e)
            return
        self._tensor = None  # ours only: the merger may still hold it, until it copied it into its buffer

    def _held(self) -> Optional[torch.Tensor]:
        """The tensor if memory still holds it (being written, or the write failed), once the write is done."""
        held = self._tensor  # still in memory: no need to wait
        if held is None:
            self._written.result()
            held = self._tensor
        if held is None and self.slot is None:
            raise ValueError("this contribution was dropped")
        return held

    def get(self) -> torch.Tensor:
        held = self._held()
        return held if held is not None else self.store._io.submit(self._read).result()

    def parts(self):
        held = self._held()
        return held if held is not None else FileParts(self.store.path(self.slot), self.numel)

    def _read(self) -> torch.Tensor:
        """Straight into a new tensor: no bytes object beside it."""
        return FileParts(self.store.path(self.slot), self.numel)[:]

    def drop(self) -> None:
        if self.slot is not None:
            self._tensor = None
            self.store.release(self.slot)
            self.slot = None

    @property
    def in_memory(self) -> bool:
        self._written.result()
        return self._tensor is not None


class FileParts:
    """A spilled Δ read a slice at a time, straight into each slice's tensor. The file is opened (and its size
    checked) at once, so a removed or truncated file fails here rather than halfway through a caller's pass."""

    def __init__(self, path: Path, numel: int):
        self.path, self._numel, self._fd = path, numel, None
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        if size != 4 * numel:
            os.close(self._fd)
            self._fd = None
            raise OSError(f"{path}: {size} bytes, not the {4 * numel} bytes written")

    def numel(self) -> int:
        return self._numel

    def __getitem__(self, part: slice) -> torch.Tensor:
        start, stop, _ = part.indices(self._numel)
        out = torch.empty(max(stop - start, 0), dtype=torch.float32)
        got = os.preadv(self._fd, [memoryview(out.numpy()).cast("B")], 4 * start)
        if got != 4 * out.numel():
            raise OSError(f"{self.path}: short read at element {start}")
        return out

    def __del__(self):
        if self._fd is not None:
            os.close(self._fd)
