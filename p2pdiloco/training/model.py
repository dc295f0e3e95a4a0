"""A small decoder-only transformer in plain torch: RMSNorm, causal SDPA, tied byte embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from p2pdiloco.config import ModelConfig


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ByteGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # recompute each block's activations in the backward pass instead of keeping them (the trainer's
        # --activation-checkpointing): one block's worth held at a time, for one more forward pass of compute
        self.checkpoint_blocks = False
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.apply(_init_weights)
        for block in self.blocks:  # scale residual writes by depth (GPT-2)
            for proj in (block.proj, block.down):
                nn.init.normal_(proj.weight, std=0.02 / (2 * cfg.n_layers) ** 0.5)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        logits = self.norm(x) @ self.embed.weight.T  # tied output head
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


def build_model(cfg: ModelConfig, seed: int) -> ByteGPT:
    """Every peer of a run builds bit-identical initial weights from the same seed, on the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ByteGPT(cfg)


def rda_segments(model: nn.Module, plain: tuple[str, ...] = ("embed", "pos")) -> list[tuple[int, int]]:
    """[start, end) of every tensor in the flat parameter vector that RDA averages; embeddings (`plain`)
    keep the plain weighted mean, as Decoupled DiLoCo does."""
    segments, offset = [], 0
    for name, p in model.named_parameters():
        if not name.split(".")[0] in plain:
            segments.append((offset, offset + p.numel()))
        offset += p.numel()
    return segments
