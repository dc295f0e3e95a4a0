"""The inner loop: H steps of AdamW on this peer's own data stream. No networking here."""

from __future__ import annotations

import time
from typing import Iterator

import torch
from torch import nn

from p2pdiloco.config import InnerConfig


def flat_params(model: nn.Module) -> torch.Tensor:
    """The model's parameters as one fp32 CPU vector (the layout every peer shares)."""
    return torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def load_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    assert offset == flat.numel(), "flat vector does not match the model"


class InnerTrainer:
    """Owns the local model and its AdamW state, which are kept across rounds (as DiLoCo prescribes)."""

    def __init__(self, model: nn.Module, batches: Iterator, cfg: InnerConfig, device: torch.device,
                 throttle: float = 1.0):
        self.model, self.batches, self.cfg, self.device, self.throttle = model, batches, cfg, device, throttle
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.95))
        self.total_steps = 0  # over the peer's life: drives the warm-up

    def lr_at(self, step: int) -> float:
        if self.cfg.warmup_steps == 0:
            return self.cfg.lr
        return self.cfg.lr * min(1.0, (step + 1) / self.cfg.warmup_steps)

    def train_step(self) -> float:
        inputs, targets = (t.to(self.device, non_blocking=True) for t in next(self.batches))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.total_steps)
        loss = self.model(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.total_steps += 1
        return loss.item()  # a device sync point: once per step is fine at these sizes

    def timed_step(self) -> tuple[float, float]:
        """One inner step; returns (loss, wall seconds). A throttled peer sleeps in proportion, so it behaves
        like a slower machine, and that sleep counts as step time (it stands for compute)."""
        start = time.perf_counter()
        loss = self.train_step()
        elapsed = time.perf_counter() - start
        if self.throttle > 1.0:
            time.sleep(elapsed * (self.throttle - 1.0))
        return loss, time.perf_counter() - start

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, device: torch.device) -> float:
    was_training = model.training
    model.eval()
    losses = [model(x.to(device), y.to(device)).item() for x, y in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
