"""Where Θ and the outer momentum live: in memory, or parked in a file and paged in only while used.

Between rounds nothing reads Θ or the outer momentum (8 bytes per parameter): the inner steps touch θ and the
inner optimizer only. Θ is read when a contribution is made (Δ = Θ − θ), when a round's outcome is applied,
by an evaluation, a checkpoint, a state served to a joiner; the momentum only by the outer step, the digest and
those last two. `Parked` keeps both in one file mapped shared, and `let_go` drops its pages from the
process once a use is over (p2pdiloco.runtime.paging), so a peer's resident memory is that of the inner loop.

What it costs: each round rewrites all of Θ and the momentum, so the kernel writes 8 bytes per parameter to
disk per round (2 per round for checkpoints every 5 rounds, by comparison); reading them back from disk,
where the cache lost them, takes about a second per GB. A folder that cannot hold them (a full disk) keeps
them in memory, saying so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from torch import nn

from p2pdiloco.runtime.paging import FLOAT32, FileVectors

log = logging.getLogger(__name__)


class Held:
    """Θ and the momentum as two ordinary tensors."""

    def __init__(self, n: int):
        self.theta, self.momentum = torch.empty(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)

    def let_go(self, part: Optional[slice] = None) -> None:
        pass


class Parked:
    """Θ and the momentum in one unlinked file of `folder`, mapped shared (p2pdiloco.runtime.paging)."""

    def __init__(self, n: int, folder: Path):
        self._file = FileVectors(n, 2, folder, prefix="global-state-")
        # fallocate's blocks read as zeros: the momentum starts at 0, Θ is written by the caller
        self.theta, self.momentum = self._file.vectors

    def let_go(self, part: Optional[slice] = None) -> None:
        """Drop the pages (of elements `part` of both vectors, or all) from this process. A long pass (the outer
        step, a rebase) pages out as it goes, so Θ and the momentum are never all in memory at once."""
        self._file.let_go(part)

    def resident_bytes(self) -> Optional[int]:
        return self._file.resident_bytes()


def global_vectors(n: int, folder: Optional[Path]) -> Held | Parked:
    """Parked in `folder` if given and it can hold them; in memory otherwise (with a warning if it cannot)."""
    if folder is None:
        return Held(n)
    try:
        return Parked(n, folder)
    except (OSError, ValueError) as e:
        log.warning("cannot park the global state in %s (%s): it stays in memory (%.2f GB)", folder, e,
                    2 * n * FLOAT32 / 1e9)
        return Held(n)


def parked_parameters(model: nn.Module, folder: Path) -> Optional[FileVectors]:
    """A model's parameters moved into one unlinked file of `folder`, mapped shared (with --fsdp, rank 0's mirror
    of θ: read and written only around rounds, checkpoints and restores), or None where the folder cannot hold
    them (they stay in memory, with a warning). `let_go` on the result drops their pages from this process."""
    from p2pdiloco.training.inner import param_slices  # inner imports torch's FSDP: only a peer that parks

    n = sum(p.numel() for _, p, _ in param_slices(model))
    try:
        file = FileVectors(n, 1, folder, prefix="mirror-")
    except (OSError, ValueError) as e:
        log.warning("cannot park θ's whole copy in %s (%s): it stays in memory (%.2f GB)", folder, e,
                    n * FLOAT32 / 1e9)
        return None
    flat = file.vectors[0]
    with torch.no_grad():
        for _, p, part in param_slices(model):
            view = flat[part].view_as(p)
            view.copy_(p)
            p.data = view  # a tied parameter is one Parameter: rebound once
    file.let_go()
    return file
