"""The model: a Llama-family causal LM from `transformers`, built from a preset shape, a config.json or model
folder, or a hub id, and wrapped so the trainer calls it as `model(tokens, targets) -> loss`.

Every peer of a run builds bit-identical initial weights from the same seed, on the CPU (or loads the same
pretrained weights with --init-from). The wrapped model is the `transformers` model itself (`CausalLM.hf`):
`save_pretrained` writes what `AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from p2pdiloco.config import MODEL_PRESETS, ConfigError, ModelShape, model_preset

VOCAB_MULTIPLE = 64  # a preset's embedding rows: the tokenizer's vocabulary rounded up (faster matmuls)
MIN_POSITIONS = 2048
# config keys that say nothing about the function the weights compute
VOLATILE = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "use_cache",
            "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict"}


class ModelError(ConfigError):
    """A model cannot be built or loaded; the message says what to do."""


class CausalLM(nn.Module):
    """A `transformers` causal LM as the trainer calls it: logits, or the mean cross-entropy against `targets`
    (inputs shifted by one, as the data streams cut them)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.hf(input_ids=tokens, use_cache=False).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def blocks(self) -> list[nn.Module]:
        """The repeated blocks (decoder layers): the modules transformers keeps whole across devices."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        return [m for m in self.hf.modules() if type(m).__name__ in names]

    def compile_blocks(self) -> None:
        """Compile each block with torch.compile, in place: the names of the parameters, the state dict and
        the flat vector stay as they were. One compiled graph serves every block of the same shape (the
        parameters are its inputs); the first inner step waits for it. Fusing the Llama's elementwise work
        (RMSNorm in fp32, RoPE, SwiGLU) is what brings it to the GPU's speed (docs/data.md)."""
        found = self.blocks()
        if not found:
            raise ModelError(f"--compile: {type(self.hf).__name__} names no repeated blocks to compile")
        for block in found:
            block.compile()

    @property
    def checkpoint_blocks(self) -> bool:
        """Whether each decoder layer's activations are recomputed in the backward pass (transformers' own
        gradient checkpointing, non-reentrant: the same bits as without it)."""
        return bool(self.hf.is_activation_checkpointing)

    @checkpoint_blocks.setter
    def checkpoint_blocks(self, on: bool) -> None:
        if on:
            self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(use_reentrant=False))
        else:
            self.hf.activation_checkpointing_disable()


def preset_config(shape: ModelShape, vocab_size: int, max_positions: int = MIN_POSITIONS):
    from transformers import LlamaConfig

    head_dim = shape.hidden // shape.heads
    return LlamaConfig(vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, hidden_size=shape.hidden,
                       intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=head_dim,
                       tie_word_embeddings=shape.tied, rope_theta=shape.rope_theta,
                       max_position_embeddings=max(MIN_POSITIONS, max_positions), use_cache=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def resolve_config(model: str, vocab_size: int, max_positions: int = MIN_POSITIONS,
                   init_from: Optional[str] = None):
    """The `transformers` config of --model (or of --init-from's weights), checked against the tokenizer."""
    if init_from is not None:
        config = _load_config(init_from)
    elif model in MODEL_PRESETS:
        config = preset_config(model_preset(model), vocab_size, max_positions)
    else:
        config = _load_config(model)
    if config.model_type not in _causal_types():
        raise ModelError(f"--model {model}: a {config.model_type} config is not a causal language model")
    if vocab_size > config.vocab_size:
        raise ModelError(f"the tokenizer has {vocab_size} ids but the model only {config.vocab_size} embeddings: "
                         "use the model's own tokenizer, or a preset (its vocabulary follows the tokenizer)")
    return config


def import_model_code(model: str) -> None:
    """Import the `transformers` classes that build --model (lazy imports, seconds each) without building it: a
    preset's, or a local config's. A hub id is left to the peer (it may need the network), as is any error."""
    import transformers

    if model not in MODEL_PRESETS and not Path(model).exists():
        return
    try:
        config = preset_config(model_preset(model), 256) if model in MODEL_PRESETS else _load_config(model)
        transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the lookup imports the class's module
    except (ModelError, KeyError, ValueError):
        pass


def _causal_types() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _load_config(source: str):
    """A config.json, a model folder, or a hub id; one line saying why not."""
    from transformers import AutoConfig

    path = Path(source)
    try:
        if path.is_file():
            return AutoConfig.from_pretrained(str(path.parent) if path.name == "config.json" else str(path),
                                              local_files_only=True)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(f"--model {source}: a folder without a config.json")
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        return AutoConfig.from_pretrained(source)
    except ModelError:
        raise
    except Exception as e:  # offline, unknown id, a config transformers cannot read: all one line
        where = "the hub could not provide it (offline?)" if not path.exists() else "transformers cannot read it"
        raise ModelError(f"--model {source}: {where}: {str(e).splitlines()[0][:200]}") from None


def build_model(config, seed: int, init_from: Optional[str] = None) -> CausalLM:
    """Bit-identical on every peer: seeded on the CPU (or the same pretrained weights). `config`: a
    `transformers` config, or a preset name (the byte vocabulary: tests and tools)."""
    from transformers import AutoModelForCausalLM

    if isinstance(config, str):
        config = resolve_config(config, vocab_size=257)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if init_from is not None:
                hf = AutoModelForCausalLM.from_pretrained(init_from, config=config, dtype=torch.float32,
                                                          attn_implementation="sdpa",
                                                          local_files_only=Path(init_from).exists())
            else:
                hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
                scale_residual_init(hf, config)
    except (ValueError, TypeError, OSError, KeyError) as e:
        raise ModelError(f"transformers cannot build this model: {str(e).splitlines()[0][:200]}") from None
    hf.config.use_cache = False
    return CausalLM(hf)


RESIDUAL_WRITES = ("o_proj.weight", "down_proj.weight")  # the layers that add to the residual stream


@torch.no_grad()
def scale_residual_init(hf: nn.Module, config) -> None:
    """Draw the residual stream's writers at std / √(2·layers) (GPT-2's rule, as nanoGPT and OLMo do), so the
    stream's variance does not grow with depth. transformers draws them at the plain std; on the tiny preset
    that left the global model 0.41 nats behind after 80 steps of DiLoCo (2.97 against 2.57, M = 1, H = 20)."""
    std = getattr(config, "initializer_range", 0.02) / (2 * max(1, config.num_hidden_layers)) ** 0.5
    for name, p in hf.named_parameters():
        if name.endswith(RESIDUAL_WRITES) and p.device.type != "meta":
            p.normal_(0.0, std)


def config_fingerprint(config) -> str:
    """sha256 of what the config says about the function (not its transformers version or file name)."""
    values = {k: v for k, v in config.to_dict().items() if k not in VOLATILE}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def rda_segments(model: nn.Module) -> list[tuple[int, int]]:
    """[start, end) of every tensor in the flat parameter vector that RDA averages; embeddings and the output
    head keep the plain weighted mean, as Decoupled DiLoCo does."""
    segments, offset = [], 0
    for name, p in model.named_parameters():
        if not any(part in name for part in ("embed_tokens", "lm_head", "wte", "wpe")):
            segments.append((offset, offset + p.numel()))
        offset += p.numel()
    return segments
