"""`p2pdiloco data prepare`: text in (files, folders, JSONL, Parquet, a hub dataset), token shards out.

Sources are read through `datasets`, streaming, so a corpus larger than memory passes through a batch at a
time. Documents are tokenized in batches by the Rust tokenizer (every core), each ended by the end-of-text mark,
and packed into shards of whole documents. Documents are cut into pieces of at most `PIECE` tokens for the split
(a short document is one piece): every `VAL_EVERY`-th piece goes to the validation split until it holds
`val_tokens`, so a source of one long document is split too.

Interrupted, it resumes: a shard is sealed (written under a temporary name, renamed, hashed) together with a
progress record of the documents it holds, and a rerun skips those documents. The manifest is written last, so
a folder that looks finished is finished.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from p2pdiloco.training import tokenizer as tokenizers
from p2pdiloco.runtime.files import sha256_file
from p2pdiloco.training.shards import FORMAT, MANIFEST, TOKENIZER_DIR, DataError, token_dtype

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
VAL_EVERY = 20
PIECE = 1 << 16  # tokens: the unit of the train/validation split
BIG_TEXT_FILE = 16 << 20  # bytes: a text file larger than this is read a paragraph (blank-line block) at a time
BATCH_DOCS = 256  # documents per tokenizer call
PARTIAL = ".partial"
BUILTIN = "builtin:shakespeare"  # the built-in corpus as a source (p2pdiloco.training.data.builtin_corpus_dir)
MIN_VAL_TOKENS = 4096


@dataclass(frozen=True)
class Plan:
    sources: tuple[str, ...]
    tokenizer: str
    out: Path
    shard_tokens: int = 1 << 26  # 64M tokens: 128 MB of uint16
    val_tokens: int = 1 << 20
    text_field: str = "text"
    subset: Optional[str] = None  # a hub dataset's configuration


@dataclass
class Progress:
    """What is sealed: the documents consumed into sealed shards, the shards, the validation tokens so far."""

    settings: dict
    documents: int = 0
    pieces: int = 0  # of the documents above, for the split
    bytes: int = 0
    shards: list = field(default_factory=list)
    val_tokens: int = 0
    val_bytes: int = 0


# ---- reading sources ----------------------------------------------------------------------------------------
def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise DataError(f"{path}: unsupported source format (text {', '.join(TEXT_SUFFIXES)}; JSONL "
                    f"{', '.join(JSON_SUFFIXES)}; Parquet .parquet; or a hub dataset id)")


def _files(path: Path) -> list[Path]:
    if path.is_file():
        _kind(path)
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    kept = [p for p in files if _supported(p)]
    if not kept:
        raise DataError(f"{path}: no text, JSONL or Parquet files under it")
    return kept


def _supported(path: Path) -> bool:
    try:
        _kind(path)
        return True
    except DataError:
        return False


def local_path(source: str) -> Path:
    """A source's path on this machine (the built-in corpus by its name)."""
    if source == BUILTIN:
        from p2pdiloco.training.data import builtin_corpus_dir

        return builtin_corpus_dir()
    return Path(source)


def source_bytes(sources: Iterable[str]) -> Optional[int]:
    """The local sources' size on disk (the progress bar's total), or None with a hub dataset among them."""
    total = 0
    for source in map(str, map(local_path, sources)):
        if not Path(source).exists():
            return None
        total += sum(f.stat().st_size for f in _files(Path(source)))
    return total


def iter_texts(sources: Iterable[str], text_field: str = "text", subset: Optional[str] = None) -> Iterator[str]:
    """Every document of every source, in order, streamed through `datasets`."""
    for source in sources:
        path = local_path(source)
        if path.exists():
            files = _files(path)
            for kind in ("text", "json", "parquet"):
                group = [f for f in files if _kind(f) == kind]
                if kind == "text":  # a file is a document, but a big one is read a paragraph at a time
                    small = [str(f) for f in group if f.stat().st_size <= BIG_TEXT_FILE]
                    big = [str(f) for f in group if f.stat().st_size > BIG_TEXT_FILE]
                    yield from _stream(kind, dict(data_files=small, sample_by="document"), text_field, source)
                    yield from _stream(kind, dict(data_files=big, sample_by="paragraph"), text_field, source)
                elif group:
                    yield from _stream(kind, dict(data_files=[str(f) for f in group]), text_field, source)
        else:
            yield from _stream_hub(source, subset, text_field)


def _stream(builder: str, kwargs: dict, text_field: str, where: str) -> Iterator[str]:
    from datasets import load_dataset

    if not kwargs["data_files"]:
        return
    field_name = "text" if builder == "text" else text_field
    try:
        rows = load_dataset(builder, split="train", streaming=True, **kwargs)
        for row in rows:
            yield _text_of(row, field_name, where)
    except DataError:
        raise
    except Exception as e:  # pyarrow / json errors on a malformed file: one line
        raise DataError(f"{where}: cannot read it as {builder}: {str(e).splitlines()[0][:200]}") from None


def _stream_hub(dataset_id: str, subset: Optional[str], text_field: str) -> Iterator[str]:
    from datasets import load_dataset

    try:
        rows = iter(load_dataset(dataset_id, subset, split="train", streaming=True))
        first = next(rows, None)
    except Exception as e:  # offline, an unknown id
        raise DataError(f"{dataset_id}: not a local file or folder, and the hub could not provide it "
                        f"({str(e).splitlines()[0][:160]}); offline, give local files") from None
    if first is not None:
        yield _text_of(first, text_field, dataset_id)
        for row in rows:
            yield _text_of(row, text_field, dataset_id)


def _text_of(row: dict, text_field: str, where: str) -> str:
    value = row.get(text_field)
    if not isinstance(value, str):
        raise DataError(f"{where}: a record without a string field {text_field!r} (name it with --text-field)")
    return value


# ---- preparing ----------------------------------------------------------------------------------------------
def prepare(plan: Plan, on_bytes: Callable[[int], None] = lambda n: None) -> dict:
    """Write the dataset; returns its manifest. Resumes an interrupted prepare into the same folder."""
    out = plan.out
    if (out / MANIFEST).exists():
        raise DataError(f"{out} already holds a prepared dataset; choose another --out")
    tok = tokenizers.load_tokenizer(plan.tokenizer)
    settings = dict(sources=list(plan.sources), tokenizer=tokenizers.fingerprint(tok),
                    shard_tokens=plan.shard_tokens, val_tokens=plan.val_tokens, text_field=plan.text_field,
                    subset=plan.subset)
    dtype = token_dtype(tokenizers.vocab_size(tok))
    progress = _resume(out / PARTIAL, settings, dtype)
    writer = _Writer(out, progress, dtype, plan, tokenizers.token_bytes(tok))
    eos = tokenizers.eos_id(tok)
    texts = iter_texts(plan.sources, plan.text_field, plan.subset)
    skipped = 0
    for text in texts:  # sealed documents: read (a stream cannot seek) but not tokenized again
        if skipped >= progress.documents:
            break
        skipped += 1
        on_bytes(len(text.encode("utf-8")))
    else:
        text = None
    pending = [] if text is None else [text]
    for batch in _batches(pending, texts):
        for doc, ids in zip(batch, tokenizers.encode_batch(tok, batch)):
            size = len(doc.encode("utf-8"))
            writer.add(np.asarray([*ids, eos]), size)
            on_bytes(size)
    return writer.finish(tok)


def _batches(first: list[str], rest: Iterator[str]) -> Iterator[list[str]]:
    batch = list(first)
    for text in rest:
        batch.append(text)
        if len(batch) >= BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


def _resume(partial: Path, settings: dict, dtype: np.dtype) -> Progress:
    record = partial / "progress.json"
    if not record.is_file():
        partial.mkdir(parents=True, exist_ok=True)
        return Progress(settings=settings)
    saved = json.loads(record.read_text())
    if saved["settings"] != settings:
        raise DataError(f"{partial.parent} holds an unfinished prepare with other settings; give the same sources "
                        "and options to resume it, or choose another --out")
    progress = Progress(**saved)
    with (partial / "val.bin").open("r+b") as f:  # tokens appended after the last seal are not counted: cut
        f.truncate(progress.val_tokens * dtype.itemsize)
    return progress


class _Writer:
    """Packs documents into shards; seals each with a progress record, so a rerun resumes after it."""

    def __init__(self, out: Path, progress: Progress, dtype: np.dtype, plan: Plan, token_bytes: np.ndarray):
        self.out, self.progress, self.dtype, self.plan, self.token_bytes = out, progress, dtype, plan, token_bytes
        self.partial = out / PARTIAL
        (self.partial / "val.bin").touch()
        self.buffer: list[np.ndarray] = []
        self.buffered = self.buffered_bytes = self.buffered_docs = 0
        self.val: list[np.ndarray] = []
        self.val_pending = self.val_pending_bytes = 0
        self.seen = progress.documents  # documents routed so far (sealed or buffered)
        self.pieces = progress.pieces

    def add(self, ids: np.ndarray, n_bytes: int) -> None:
        ids = ids.astype(self.dtype)
        self.seen += 1
        self.buffered_docs += 1
        self.buffered_bytes += n_bytes
        for start in range(0, len(ids), PIECE):
            piece = ids[start:start + PIECE]
            held = 0  # what the validation split takes of it: all of it, or what is left of its budget
            if self.pieces % VAL_EVERY == 0:
                held = max(0, min(len(piece), self.plan.val_tokens - self.progress.val_tokens - self.val_pending))
            self.pieces += 1
            if held:
                self.val.append(piece[:held])
                self.val_pending += held
                self.val_pending_bytes += int(self.token_bytes[piece[:held]].sum())
            if held < len(piece):
                self.buffer.append(piece[held:])
                self.buffered += len(piece) - held
        if self.buffered >= self.plan.shard_tokens:
            self.seal()

    def seal(self) -> None:
        """Write the buffered shard and the held-out documents, then record them: a kill before the record
        leaves the previous record true (the shard is rewritten, the extra validation tokens cut)."""
        p = self.progress
        if self.buffer:
            name = f"train-{len(p.shards):05d}.bin"
            tmp = self.partial / (name + ".tmp")
            np.concatenate(self.buffer).tofile(tmp)
            _fsync(tmp)
            os.replace(tmp, self.out / name)
            p.shards.append(dict(file=name, tokens=self.buffered, sha256=sha256_file(self.out / name)))
        if self.val:
            with (self.partial / "val.bin").open("ab") as f:
                np.concatenate(self.val).tofile(f)
        p.documents, p.pieces, p.bytes = self.seen, self.pieces, p.bytes + self.buffered_bytes
        p.val_tokens, p.val_bytes = p.val_tokens + self.val_pending, p.val_bytes + self.val_pending_bytes
        _write_json(self.partial / "progress.json", p.__dict__)
        self.buffer, self.val = [], []
        self.buffered = self.buffered_bytes = self.buffered_docs = self.val_pending = self.val_pending_bytes = 0

    def finish(self, tok) -> dict:
        self.seal()
        p = self.progress
        if p.val_tokens < MIN_VAL_TOKENS or not p.shards:
            raise DataError(f"the sources hold too little text for a dataset: {p.val_tokens} validation tokens "
                            f"(at least {MIN_VAL_TOKENS}) and {sum(s['tokens'] for s in p.shards)} training tokens; "
                            "give more text")
        os.replace(self.partial / "val.bin", self.out / "val.bin")
        tok.save_pretrained(str(self.out / TOKENIZER_DIR))
        manifest = dict(
            format=FORMAT, dtype=self.dtype.str, shards=p.shards,
            val=dict(file="val.bin", tokens=p.val_tokens, sha256=sha256_file(self.out / "val.bin"),
                     bytes=p.val_bytes),
            tokenizer=dict(sha256=p.settings["tokenizer"], vocab_size=tokenizers.vocab_size(tok),
                           eos_id=tokenizers.eos_id(tok), source=self.plan.tokenizer),
            split=dict(rule=f"every {VAL_EVERY}th piece (a document, cut at {PIECE} tokens) to validation, up to "
                            f"{self.plan.val_tokens} tokens"),
            sources=p.settings["sources"], documents=p.documents, text_bytes=p.bytes,
            train_tokens=sum(s["tokens"] for s in p.shards), made=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        _write_json(self.out / MANIFEST, manifest)  # last: the folder is a dataset from here on
        shutil.rmtree(self.partial, ignore_errors=True)
        return manifest


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    _fsync(tmp)
    os.replace(tmp, path)
