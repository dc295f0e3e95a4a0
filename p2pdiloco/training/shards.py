"""Prepared token datasets on disk: what `p2pdiloco data prepare` writes and every peer reads from.

A dataset folder holds `train-NNNNN.bin` shards and `val.bin` (raw little-endian token ids, uint16 where the
vocabulary fits, else uint32), the tokenizer that cut them (`tokenizer/`), and `manifest.json`, written last:
a folder without it is unfinished. The manifest lists each shard's sha256 and token count; a peer checks them
when it opens the dataset, so a damaged or swapped shard is refused before it trains a step on it.

A peer reads each window with one `pread` (`TokenFile`): it holds the windows it trains on, nothing of the
shards, so a peer on 10B tokens holds what it holds on 10M.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p2pdiloco.runtime.files import sha256_file

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = 1


class DataError(ValueError):
    """The data cannot be loaded; the message says what to do."""


def token_dtype(vocab: int) -> np.dtype:
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class Dataset:
    """One opened dataset: its training shards and validation tokens, read a window at a time."""

    folder: Path
    manifest: dict
    train: list["TokenFile"]
    val: "TokenFile"

    @property
    def fingerprint(self) -> str:
        """sha256 of the manifest: the shards' hashes, the tokenizer's, the split."""
        return hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.manifest["tokenizer"]["sha256"]

    @property
    def description(self) -> str:
        tokens = sum(len(s) for s in self.train)
        return f"{self.folder.name}: {tokens / 1e6:.1f}M train tokens in {len(self.train)} shards, " \
               f"{len(self.val) / 1e6:.2f}M validation"


def is_dataset(folder: Path) -> bool:
    """A prepared dataset, finished or not (an unfinished one is refused by `open_dataset`, saying so)."""
    folder = Path(folder)
    return (folder / MANIFEST).is_file() or (folder.is_dir() and (
        (folder / ".partial").is_dir() or any(folder.glob("train-*.bin"))))


def open_dataset(folder: Path, verify: bool = True) -> Dataset:
    """The dataset in `folder`, each shard checked against its manifest entry (size, and sha256 if `verify`)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    dtype = np.dtype(manifest["dtype"])
    shards = [_map(folder, entry, dtype, verify) for entry in manifest["shards"]]
    val = _map(folder, manifest["val"], dtype, verify)
    return Dataset(folder=folder, manifest=manifest, train=shards, val=val)


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        if is_dataset(folder):
            raise DataError(f"{folder}: an unfinished prepare (no {MANIFEST} yet): run the same "
                            "'p2pdiloco data prepare' again to resume it")
        raise DataError(f"{folder}: no {MANIFEST}: not a dataset from 'p2pdiloco data prepare'")
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT or np.dtype(manifest["dtype"]).kind != "u":
            raise ValueError(f"format {manifest.get('format')!r}")
        for entry in [*manifest["shards"], manifest["val"]]:
            int(entry["tokens"]), str(entry["file"]), str(entry["sha256"])
        manifest["tokenizer"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a readable manifest ({e}); prepare the dataset again") from None
    if not manifest["shards"]:
        raise DataError(f"{path}: no training shards")
    return manifest


def _map(folder: Path, entry: dict, dtype: np.dtype, verify: bool) -> "TokenFile":
    path = folder / entry["file"]
    if path.name != entry["file"] or not path.is_file():  # a manifest naming files outside its folder: refused
        raise DataError(f"{path}: missing (listed in {folder / MANIFEST}); copy the whole dataset folder")
    if path.stat().st_size != int(entry["tokens"]) * dtype.itemsize:
        raise DataError(f"{path}: {path.stat().st_size} bytes, but the manifest says {entry['tokens']} tokens; "
                        "the shard is damaged or from another dataset: copy it again")
    if verify and sha256_file(path) != entry["sha256"]:
        raise DataError(f"{path}: its sha256 does not match the manifest; the shard is damaged or from another "
                        "dataset: copy it again, or prepare the dataset again")
    return TokenFile(path, dtype, int(entry["tokens"]))


class TokenFile:
    """A shard of token ids on disk, sliced like an array: each slice is one `pread`, a fresh array. Not a memory
    map: a mapping faults in the page cache's large folios whole, and 50 batches of random windows left 0.95 GB of
    a 1 GB dataset in the process's resident memory (reclaimable, but counted, cgroup limits included)."""

    def __init__(self, path: Path, dtype: np.dtype, tokens: int):
        self.path, self.dtype, self.tokens = Path(path), np.dtype(dtype), tokens
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a token file reads contiguous slices only")
        start, stop, _ = key.indices(self.tokens)
        size = self.dtype.itemsize
        raw = os.pread(self._fd, max(0, stop - start) * size, start * size)
        return np.frombuffer(raw, dtype=self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def __del__(self):
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)
