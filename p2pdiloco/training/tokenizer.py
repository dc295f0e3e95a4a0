"""Tokenizers, all through Hugging Face `tokenizers` / `transformers`: `bytes` (256 ids and an end-of-text mark,
nothing to ship or download), a folder written by `p2pdiloco tokenizer train` (or any tokenizer folder
`transformers` loads), or a hub id.

Every peer of a run must cut text the same way: `fingerprint` hashes the tokenizer's whole definition, and it
joins the settings compared at join time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

BYTES = "bytes"
EOS = "<|endoftext|>"  # between documents; its id is `eos_id`
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or trained; the message says what to do."""


def byte_to_char() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (the GPT-2 convention `tokenizers`' ByteLevel uses):
    printable Latin-1 bytes stand for themselves, the others are moved past 255, so every token is a string."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def _byte_level(model, split_words: bool = True):
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tok.decoder = decoders.ByteLevel()
    return tok


def _wrap(tok):
    """A `transformers` tokenizer around a `tokenizers` one: what `save_pretrained` writes, AutoTokenizer loads."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=None, unk_token=None,
                                   pad_token=None, clean_up_tokenization_spaces=False)


def byte_tokenizer():
    """One token per byte: id b is byte b; id 256 is the end-of-text mark."""
    from tokenizers import models

    chars = byte_to_char()
    vocab = {chars[b]: b for b in range(256)}
    tok = _byte_level(models.BPE(vocab=vocab, merges=[]), split_words=False)  # no merges: words need no split
    tok.add_special_tokens([EOS])
    return _wrap(tok)


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False):
    """A byte-level BPE trained on `texts` (every byte stays representable, so any text encodes)."""
    from tokenizers import models, pre_tokenizers, trainers

    if not 257 < vocab_size <= 1 << 20:
        raise TokenizerError(f"--vocab-size must be above 257 (the bytes and the end-of-text mark), got {vocab_size}")
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok)


def load_tokenizer(spec: str):
    """`bytes`, a tokenizer folder (or its tokenizer.json), or a hub id (loaded only when online)."""
    if spec == BYTES:
        return byte_tokenizer()
    path = Path(spec)
    if path.name == TOKENIZER_FILE and path.is_file():
        path = path.parent
    if path.exists():
        return _load_folder(path)
    if os.path.isabs(spec) or spec.startswith(".") or spec.count("/") > 1:
        raise TokenizerError(f"--tokenizer {spec}: no such file or folder")
    return _load_hub(spec)


def _load_folder(path: Path):
    from transformers import AutoTokenizer

    if not path.is_dir() or not (path / TOKENIZER_FILE).is_file():
        raise TokenizerError(f"--tokenizer {path}: not a tokenizer folder (no {TOKENIZER_FILE}; make one with "
                             f"'p2pdiloco tokenizer train')")
    try:
        return _fast(AutoTokenizer.from_pretrained(str(path), local_files_only=True), str(path))
    except Exception as e:  # OSError, ValueError, and the tokenizers library's own exceptions: all one line
        raise TokenizerError(f"--tokenizer {path}: cannot load it: {str(e).splitlines()[0]}") from None


def _load_hub(hub_id: str):
    from transformers import AutoTokenizer

    try:
        return _fast(AutoTokenizer.from_pretrained(hub_id), hub_id)
    except Exception as e:  # offline, unknown id, gated repository: all one line
        raise TokenizerError(f"--tokenizer {hub_id}: not a local folder, and the hub could not provide it "
                             f"({str(e).splitlines()[0][:160]}); offline, pass a tokenizer folder or 'bytes'") from None


def _fast(tokenizer, where: str):
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizerError(f"--tokenizer {where}: only fast (Rust) tokenizers are supported")
    return tokenizer


def eos_id(tokenizer) -> int:
    """The id that separates documents: the tokenizer's end-of-sequence mark."""
    if tokenizer.eos_token_id is None:
        raise TokenizerError("the tokenizer has no end-of-sequence token to separate documents")
    return int(tokenizer.eos_token_id)


def vocab_size(tokenizer) -> int:
    """Ids run from 0 to this − 1 (special tokens included)."""
    return len(tokenizer)


def fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's whole definition (its vocabulary, merges, normalizer, special tokens)."""
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()


def token_bytes(tokenizer) -> np.ndarray:
    """How many bytes of UTF-8 text each id stands for (special tokens: 0), for validation in bits per byte,
    which compares runs whatever their tokenizer."""
    chars = {c: b for b, c in byte_to_char().items()}
    special = set(tokenizer.all_special_ids)
    out = np.zeros(vocab_size(tokenizer), dtype=np.int64)
    for piece, i in tokenizer.get_vocab().items():
        if i in special or i >= len(out):
            continue
        if all(c in chars for c in piece):  # byte-level BPE: each character is one byte
            out[i] = len(piece)
        else:  # other tokenizers (SentencePiece's ▁ for a space): the decoded text's bytes
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


def encode_batch(tokenizer, texts: list[str]) -> Iterator[list[int]]:
    """Each text's ids, no special tokens added; the Rust tokenizer encodes the batch on every core."""
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        yield encoding.ids
