"""`p2pdiloco data prepare`: text in (files, folders, JSONL, Parquet, a hub dataset), token shards out.

Sources are read through `datasets`, streaming, so a corpus larger than memory passes through a batch at a
time. Documents are tokenized in batches by the Rust tokenizer (every core), each ended by the end-of-text mark,
and packed into shards of whole documents. Every `VAL_EVERY`-th document goes to the validation split until it
holds `val_tokens`.

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
from p2pdiloco.training.shards import FORMAT, MANIFEST, TOKENIZER_DIR, DataError, sha256_file, token_dtype

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
VAL_EVERY = 20
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
                group = [str(f) for f in files if _kind(f) == kind]
                if group:
                    yield from _stream(kind, dict(data_files=group), text_field, source)
        else:
            yield from _stream_hub(source, subset, text_field)


def _stream(builder: str, kwargs: dict, text_field: str, where: str) -> Iterator[str]:
    from datasets import load_dataset

    if builder == "text":
        kwargs = dict(kwargs, sample_by="document")  # a file is a document
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
    writer = _Writer(out, progress, dtype, plan)
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

    def __init__(self, out: Path, progress: Progress, dtype: np.dtype, plan: Plan):
        self.out, self.progress, self.dtype, self.plan = out, progress, dtype, plan
        self.partial = out / PARTIAL
        (self.partial / "val.bin").touch()
        self.buffer: list[np.ndarray] = []
        self.buffered = self.buffered_bytes = self.buffered_docs = 0
        self.val: list[np.ndarray] = []
        self.val_pending = self.val_pending_bytes = 0
        self.seen = progress.documents  # documents routed so far (sealed or buffered)

    def add(self, ids: np.ndarray, n_bytes: int) -> None:
        ids = ids.astype(self.dtype)
        to_val = self.seen % VAL_EVERY == 0 and self.progress.val_tokens + self.val_pending < self.plan.val_tokens
        self.seen += 1
        self.buffered_docs += 1
        self.buffered_bytes += n_bytes
        if to_val:
            self.val.append(ids)
            self.val_pending += len(ids)
            self.val_pending_bytes += n_bytes
        else:
            self.buffer.append(ids)
            self.buffered += len(ids)
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
        p.documents, p.bytes = self.seen, p.bytes + self.buffered_bytes
        p.val_tokens, p.val_bytes = p.val_tokens + self.val_pending, p.val_bytes + self.val_pending_bytes
        _write_json(self.partial / "progress.json", p.__dict__)
        self.buffer, self.val = [], []
        self.buffered = self.buffered_bytes = self.buffered_docs = self.val_pending = self.val_pending_bytes = 0

    def finish(self, tok) -> dict:
        self.seal()
        p = self.progress
        if p.val_tokens < MIN_VAL_TOKENS or not p.shards:
            raise DataError(f"the sources hold too little text for a validation shard ({p.val_tokens} held-out "
                            f"tokens, at least {MIN_VAL_TOKENS}) and training shards; give more text")
        os.replace(self.partial / "val.bin", self.out / "val.bin")
        tok.save_pretrained(str(self.out / TOKENIZER_DIR))
        manifest = dict(
            format=FORMAT, dtype=self.dtype.str, shards=p.shards,
            val=dict(file="val.bin", tokens=p.val_tokens, sha256=sha256_file(self.out / "val.bin"),
                     bytes=p.val_bytes),
            tokenizer=dict(sha256=p.settings["tokenizer"], vocab_size=tokenizers.vocab_size(tok),
                           eos_id=tokenizers.eos_id(tok), source=self.plan.tokenizer),
            split=dict(rule=f"every {VAL_EVERY}th document to validation, up to {self.plan.val_tokens} tokens"),
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
