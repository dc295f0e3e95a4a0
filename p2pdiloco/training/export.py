"""From a checkpoint to a Hugging Face model folder (`p2pdiloco export`) or a quick look at its text
(`p2pdiloco sample`).

The global model Θ is what is exported: the state every peer of the swarm converges to (θ, a peer's local
model, runs ahead of it between rounds). The folder holds config.json, model.safetensors and the tokenizer's
files; `AutoModelForCausalLM.from_pretrained(folder)` gives the peer's logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from p2pdiloco.training import checkpoint
from p2pdiloco.training.inner import load_flat_params
from p2pdiloco.training.model import CausalLM, build_model


class ExportError(RuntimeError):
    """The checkpoint cannot be exported; the message says why."""


@dataclass
class Exported:
    model: CausalLM
    tokenizer: object
    checkpoint: Path
    version: int


def find_checkpoint(path: Path) -> Path:
    """A checkpoint folder, or the newest checkpoint under a peer's, a run's or a --checkpoint-dir folder."""
    path = Path(path)
    if (path / checkpoint.META).is_file():
        return path
    candidates, level = [], [path] if path.is_dir() else []
    for _ in range(3):  # CHECKPOINT_DIR / RUN_ID / NAME / v...
        candidates += [c for folder in level for c in checkpoint.list_checkpoints(folder)]
        level = [sub for folder in level for sub in folder.iterdir() if sub.is_dir()]
    if not candidates:
        raise ExportError(f"{path}: no checkpoint there (give a checkpoint folder, or a peer's, a run's or a "
                          "--checkpoint-dir folder)")
    return max(candidates, key=lambda c: (c.name, c.parent.name))  # v<version>-<step>: the newest state


def load_exported(path: Path) -> Exported:
    """The global model of the newest checkpoint under `path`, verified, and the tokenizer its peer kept; or a
    folder `export` wrote, loaded by transformers."""
    from transformers import AutoConfig

    from p2pdiloco.training.tokenizer import TokenizerError, load_tokenizer

    if (Path(path) / "config.json").is_file():
        return _load_hf_folder(Path(path))
    folder = find_checkpoint(path)
    try:
        meta = json.loads((folder / checkpoint.META).read_text())
        values = dict(meta["model_config"])
        n_params = int(meta["n_params"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{folder}: not a checkpoint with a model config ({e}); was it written by an older "
                          "p2pdiloco?") from None
    try:
        found = checkpoint.load_one(folder, n_params)
    except checkpoint.CheckpointError as e:
        raise ExportError(str(e)) from None
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = build_model(config, seed=0)
    load_flat_params(model, found.tensors["global"])
    try:
        tokenizer = load_tokenizer(str(folder.parent / checkpoint.TOKENIZER_DIR))
    except TokenizerError as e:
        raise ExportError(f"{folder}: the tokenizer its peer kept is missing or damaged ({e})") from None
    return Exported(model=model.eval(), tokenizer=tokenizer, checkpoint=folder, version=int(meta["version"]))


def _load_hf_folder(path: Path) -> Exported:
    from transformers import AutoModelForCausalLM

    from p2pdiloco.training.tokenizer import TokenizerError, load_tokenizer

    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
        tokenizer = load_tokenizer(str(path))
    except (OSError, ValueError, TokenizerError) as e:
        raise ExportError(f"{path}: cannot load the model folder: {str(e).splitlines()[0][:200]}") from None
    return Exported(model=CausalLM(hf).eval(), tokenizer=tokenizer, checkpoint=path, version=-1)


def export(path: Path, out: Path) -> Exported:
    """Write the Hugging Face folder; a folder that already holds a model is not overwritten."""
    out = Path(out)
    if (out / "config.json").exists():
        raise ExportError(f"{out} already holds a model; choose another --out")
    exported = load_exported(path)
    exported.model.hf.save_pretrained(str(out))
    exported.tokenizer.save_pretrained(str(out))
    return exported


@torch.no_grad()
def sample(exported: Exported, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
           top_k: int = 50, seed: int = 0) -> str:
    """A continuation of `prompt` drawn from the model (seeded: the same text for the same checkpoint)."""
    tok = exported.tokenizer
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        ids = torch.tensor([[tok.eos_token_id]])
    torch.manual_seed(seed)
    out = exported.model.hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                     temperature=temperature if temperature > 0 else None, top_k=top_k,
                                     pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
