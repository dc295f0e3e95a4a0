"""Prepared token datasets on disk: what `p2pdiloco data prepare` writes and every peer memory-maps.

A dataset folder holds `train-NNNNN.bin` shards and `val.bin` (raw little-endian token ids, uint16 where the
vocabulary fits, else uint32), the tokenizer that cut them (`tokenizer/`), and `manifest.json`, written last:
a folder without it is unfinished. The manifest lists each shard's sha256 and token count; a peer checks them
when it opens the dataset, so a damaged or swapped shard is refused before it trains a step on it.

Only the pages a peer reads come into memory: a peer on 10B tokens holds what it holds on 10M.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = 1


class DataError(ValueError):
    """The data cannot be loaded; the message says what to do."""


def token_dtype(vocab: int) -> np.dtype:
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Dataset:
    """One opened dataset: its training shards and validation tokens as read-only memory maps."""

    folder: Path
    manifest: dict
    train: list[np.ndarray]
    val: np.ndarray

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


def _map(folder: Path, entry: dict, dtype: np.dtype, verify: bool) -> np.ndarray:
    path = folder / entry["file"]
    if path.name != entry["file"] or not path.is_file():  # a manifest naming files outside its folder: refused
        raise DataError(f"{path}: missing (listed in {folder / MANIFEST}); copy the whole dataset folder")
    if path.stat().st_size != int(entry["tokens"]) * dtype.itemsize:
        raise DataError(f"{path}: {path.stat().st_size} bytes, but the manifest says {entry['tokens']} tokens; "
                        "the shard is damaged or from another dataset: copy it again")
    if verify and sha256_file(path) != entry["sha256"]:
        raise DataError(f"{path}: its sha256 does not match the manifest; the shard is damaged or from another "
                        "dataset: copy it again, or prepare the dataset again")
    if int(entry["tokens"]) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
