"""Checkpoints: atomic, verifiable, the last K kept. No networking.

Layout: CHECKPOINT_DIR/NAME/v00000012-<step>/ holds `tensors.safetensors` (Θ, outer momentum, θ, AdamW
moments) and `meta.json` (version, digest, history, counters, stream position, the tensors file's sha256). A
member whose ranks shard the model (`--fsdp`) keeps the AdamW moments in `inner-shards/` instead: each rank's part in
a file of its own (torch.distributed.checkpoint), their hashes in `meta.json`.
A checkpoint is written into a hidden temporary folder and renamed into place (rename is atomic), so a kill
at any moment leaves either the previous set or a complete new one. Loading verifies the hash, the shapes
and the digest; a damaged checkpoint is reported and the next older one is tried.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from p2pdiloco.core.exact import chunks, digest
from p2pdiloco.runtime.files import sha256_file
from p2pdiloco.runtime.paging import LetGo

TENSORS, META = "tensors.safetensors", "meta.json"
TOKENIZER_DIR = "tokenizer"  # beside a peer's checkpoints: the tokenizer its model reads (export, sample)
FORMAT = 1
SHARDS = "inner-shards"  # the entry, and the folder, of a sharded member's inner optimizer state


class CheckpointError(RuntimeError):
    pass


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a quota): the ones already saved are untouched."""


@dataclass
class Checkpoint:
    path: Path
    meta: dict
    tensors: dict[str, torch.Tensor]  # and, from a sharded member, its ranks' optimizer state (`SHARDS`)


Guard = Callable[[], ContextManager]


def save(folder: Path, meta: dict, tensors: dict[str, Entry], keep: int = 3,
         guard: Guard = contextlib.nullcontext) -> Path:
    """Write one checkpoint atomically and prune all but the newest `keep`. `guard`: held while the entries that
    read a live vector (`Released`: Θ and the momentum) are written; it raises if they no longer match `meta`.
    A `SHARDS` entry is staged first where it was not (`stage`), then moved in whole."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"v{meta['version']:08d}-{meta['inner_step']:09d}"
    tensors = stage(tensors, folder)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder))
    shards = tensors.get(SHARDS)
    try:
        full = dict(meta, format=FORMAT)
        if shards is not None:
            os.replace(shards.path, tmp / SHARDS)
            full["shards_sha256"] = {f.name: sha256_file(f) for f in sorted((tmp / SHARDS).iterdir())}
        write_safetensors(tmp / TENSORS, {k: v for k, v in tensors.items() if k != SHARDS}, guard)
        full["sha256"] = sha256_file(tmp / TENSORS)
        (tmp / META).write_text(json.dumps(full, indent=1))
        written = [tmp / TENSORS, tmp / META, *((tmp / SHARDS / name) for name in full.get("shards_sha256", ()))]
        for f in written:
            with f.open("rb") as handle:
                os.fsync(handle.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):  # a full disk, a quota: safetensors reports it as its own
            raise CheckpointWriteError(getattr(e, "strerror", None) or str(e)) from e
        raise
    for old in list_checkpoints(folder)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


class Concatenated:
    """A checkpoint entry made of several tensors, flattened and concatenated as `dtype` (θ, the model's
    parameters, is saved as one fp32 vector): each part is read when it is written, so no vector of the whole
    exists in memory, and from a GPU only one part at a time is on the host."""

    def __init__(self, parts: list[torch.Tensor], dtype: torch.dtype = torch.float32):
        self.parts, self.dtype = parts, dtype
        self.shape = (sum(p.numel() for p in parts),)

    def pieces(self) -> Iterator[torch.Tensor]:
        return iter(self.parts)


class Released:
    """A flat CPU vector written a chunk at a time, `let_go` told each chunk's elements once written: a parked
    global state (training.parked) lets those pages go, so a checkpoint never holds all of Θ and the momentum
    in memory at once. It is read where it lives, under the writer's guard (a copy would cost its size)."""

    live = True

    def __init__(self, vector: torch.Tensor, let_go: LetGo):
        self.vector, self.let_go, self.dtype, self.shape = vector, let_go, vector.dtype, tuple(vector.shape)

    def pieces(self) -> Iterator[torch.Tensor]:
        for part in chunks(self.vector.numel()):
            yield self.vector[part]  # written before the next one is asked for
            self.let_go(part)


class RankShards:
    """A folder of the inner optimizer's state that a sharded member's ranks wrote, each rank its own part
    (training.sharded.save_moments: torch.distributed.checkpoint's files), so that no rank ever holds it whole.
    Written on the training thread (every rank takes part), before the rest of the checkpoint, which may be
    written by another thread; `save` moves it into the checkpoint, and loading finds it there."""

    def __init__(self, path: Path, staged: bool = False):
        self.path, self.staged = path, staged  # staged: beside the checkpoints, to be moved into one


class ToStage:
    """A `RankShards` entry still to be written: `write(folder)` has the ranks write their parts into `folder`."""

    def __init__(self, write: Callable[[Path], None]):
        self.write = write


Entry = Union[torch.Tensor, Concatenated, Released, RankShards]


def stage(tensors: dict, folder: Path) -> dict[str, Entry]:
    """`tensors` with its `SHARDS` entry, if any, written now into a folder of its own beside the checkpoints
    (hidden as an interrupted write is, so a start after a kill removes it): from the ranks where it is a
    `ToStage`, or copied where it is a checkpoint's own (restored, and not dealt out to the ranks yet: moving it
    would take it from that checkpoint)."""
    entry = tensors.get(SHARDS)
    if entry is None or getattr(entry, "staged", False):
        return tensors
    folder.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=".tmp-shards-", dir=folder))
    try:
        if isinstance(entry, ToStage):
            entry.write(staged)
        else:
            staged.rmdir()
            shutil.copytree(entry.path, staged)
    except BaseException as e:
        shutil.rmtree(staged, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointWriteError(e.strerror or str(e)) from e
        raise
    return dict(tensors, **{SHARDS: RankShards(staged, staged=True)})


def host_copies(tensors: dict[str, Entry]) -> dict[str, Entry]:
    """What a background write needs: every entry the training thread goes on changing (θ, the inner optimizer's
    state) copied to host memory now; the live vectors (Θ and the momentum, which only a round changes) stay
    where they are, read under the write's guard."""
    def copy(entry: Entry) -> Entry:
        if getattr(entry, "live", False) or isinstance(entry, RankShards):
            return entry
        if isinstance(entry, Concatenated):
            return torch.cat([p.detach().reshape(-1).to("cpu", entry.dtype) for p in entry.parts])
        return entry.detach().to("cpu", copy=True)
    return {name: copy(entry) for name, entry in tensors.items()}


def write_safetensors(path: Path, tensors: dict[str, Entry], guard: Guard = contextlib.nullcontext) -> None:
    """The safetensors format (read back by the safetensors library), written one tensor at a time. The
    library's own save_file first turns every tensor into a bytes copy, so saving a checkpoint briefly doubled
    a peer's memory; here a CPU tensor is written from its own memory, and a GPU tensor (a GPU peer's θ and
    inner optimizer state) is copied to the host when its turn comes, never all of them at once. The live
    entries come first, all under one hold of `guard`, so a round can change Θ only before or after them."""
    live = sorted(name for name, entry in tensors.items() if getattr(entry, "live", False))
    header, offset, entries = {}, 0, []
    for name in live + sorted(set(tensors) - set(live)):
        entry = tensors[name]
        dtype = entry.dtype
        if dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"cannot save {name} of dtype {dtype}")
        size = math.prod(entry.shape) * dtype.itemsize
        header[name] = dict(dtype=SAFETENSORS_DTYPES[dtype], shape=list(entry.shape),
                            data_offsets=[offset, offset + size])
        offset += size
        entries.append(entry)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the format asks
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        with guard():
            for entry in entries[:len(live)]:
                _write_entry(f, entry)
        for entry in entries[len(live):]:
            _write_entry(f, entry)


def _write_entry(f, entry: Entry) -> None:
    for piece in (entry.pieces() if hasattr(entry, "pieces") else [entry]):
        raw = piece.detach().to("cpu", entry.dtype).contiguous().reshape(-1).view(torch.uint8)
        f.write(memoryview(raw.numpy()))


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete-looking checkpoints, newest first (temporary folders of interrupted writes are ignored)."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir() and p.name.startswith("v")), reverse=True)


def remove_interrupted(folder: Path) -> int:
    """Delete the temporary folders of writes a kill cut short (each up to a checkpoint's size): only at a
    start, when no write of this peer's can be going on. Returns how many."""
    leftovers = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(".tmp-")] if folder.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return len(leftovers)


def load_one(path: Path, n_params: int) -> Checkpoint:
    """Load and verify one checkpoint; CheckpointError says exactly what is wrong."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a p2pdiloco checkpoint of format {FORMAT}")
    if not (path / TENSORS).exists() or sha256_file(path / TENSORS) != meta.get("sha256"):
        raise CheckpointError(f"{path}: tensor file is missing, truncated or corrupt (hash mismatch)")
    try:
        tensors = load_file(str(path / TENSORS))
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read tensors ({e})") from None
    for key in ("global", "momentum", "local"):
        t = tensors.get(key)
        if t is None or t.shape != (n_params,) or t.dtype != torch.float32:
            raise CheckpointError(f"{path}: {key} tensor does not match this model ({n_params} parameters)")
    if digest(tensors["global"], tensors["momentum"]) != meta.get("digest"):
        raise CheckpointError(f"{path}: global state does not match its recorded digest")
    if "shards_sha256" in meta:
        tensors[SHARDS] = _verified_shards(path, meta["shards_sha256"])
    return Checkpoint(path, meta, tensors)


def _verified_shards(path: Path, hashes) -> RankShards:
    """The ranks' files of a sharded member's optimizer state, each as `meta.json` hashed it."""
    folder = path / SHARDS
    names = list(hashes) if isinstance(hashes, dict) else []
    if not names or any(Path(name).name != name or not (folder / name).is_file() for name in names):
        raise CheckpointError(f"{path}: the ranks' optimizer state ({SHARDS}) is missing or not as recorded")
    if any(sha256_file(folder / name) != hashes[name] for name in names):
        raise CheckpointError(f"{path}: the ranks' optimizer state ({SHARDS}) is truncated or corrupt "
                              "(hash mismatch)")
    return RankShards(folder)


def latest_meta(folder: Path) -> Optional[dict]:
    """The newest checkpoint's metadata, read without its tensors (None if there is none, or it is unreadable):
    enough to decide how to start; `load_latest` verifies the tensors when they are needed."""
    for path in list_checkpoints(folder)[:1]:
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None
    return None


def load_latest(folder: Path, n_params: int, report=lambda message: None) -> Optional[Checkpoint]:
    """The newest checkpoint that verifies; damaged ones are reported and skipped (never deleted)."""
    for path in list_checkpoints(folder):
        try:
            return load_one(path, n_params)
        except CheckpointError as e:
            report(f"skipping damaged checkpoint: {e}")
    return None


CONTRIBUTED = "contributed.json"  # beside a peer's checkpoints: its newest contribution, whatever its outcome


def contributed_file(folder: Path, fragment: Optional[int] = None) -> Path:
    """Where the newest contribution is noted (with --fragments, each fragment's apart)."""
    return folder / (CONTRIBUTED if fragment is None else f"contributed-f{fragment}.json")


def note_contribution(folder: Path, contribution, inner_step: int, stream_position: Optional[int] = None,
                      fragment: Optional[int] = None) -> None:
    """Record a contribution as it leaves (a few bytes, atomically). A checkpoint older than it holds progress that
    this contribution carried, and its island may merge it after we die: a restored peer reads this to know. Not
    fsynced (every round, on the training thread): a killed process's writes stay in the kernel's cache; only a
    machine that loses power may lose the last note, and with it this protection for one restart."""
    folder.mkdir(parents=True, exist_ok=True)
    note = dict(version=int(contribution.version), digest=str(contribution.digest), inner_step=int(inner_step),
                steps=int(contribution.steps), stream_position=stream_position, peer=str(contribution.peer),
                seconds=float(contribution.seconds))
    _write_note(folder, note, fragment)


def note_merged(folder: Path, fragment: Optional[int] = None) -> None:
    """The newest contribution's island merged it, and this life counted its seconds merged: a restart that finds
    it unsettled (its checkpoint is older) must not count them again."""
    note = last_contribution(folder, fragment)
    if note is not None and not note.get("merged"):
        _write_note(folder, dict(note, merged=True), fragment)


def _write_note(folder: Path, note: dict, fragment: Optional[int]) -> None:
    final = contributed_file(folder, fragment)
    tmp = folder / f".{final.name}.tmp"
    tmp.write_text(json.dumps(note))
    tmp.replace(final)


def last_contribution(folder: Path, fragment: Optional[int] = None) -> Optional[dict]:
    """The newest contribution noted in `folder` (None: none, or unreadable: as if none)."""
    try:
        note = json.loads(contributed_file(folder, fragment).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(note, dict) and isinstance(note.get("version"), int)
            and isinstance(note.get("inner_step"), int)):
        return None
    return note
