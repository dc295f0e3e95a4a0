"""The inner loop: H steps of AdamW (or bitsandbytes' 8-bit AdamW) on this peer's own data stream.

No networking here. On a GPU the inner steps run under bf16 autocast while the parameters, the optimizer's
master copy, stay fp32, as do the global state, the outer step and the pseudo-gradient (all on the CPU). The loss
stays on the device: the host reads it only when the metrics need it, not once per step.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch import nn

from p2pdiloco.config import ConfigError, InnerConfig
from p2pdiloco.core.exact import chunks
from p2pdiloco.training.ranks import EVERYTHING, MOMENTS, THETA, Lockstep, Ranks, RanksDiverged, Replicas, \
    data_parallel
from p2pdiloco.training.checkpoint import SHARDS, ToStage
from p2pdiloco.training.sharded import Shards, saved_shapes, shard_model, whole_moments
from p2pdiloco.training.schedule import inner_lr
from p2pdiloco.runtime.paging import LetGo, hold

log = logging.getLogger("p2pdiloco")

ALIAS = "@"  # in a checkpoint's optimizer scalars: this state is the tensor saved under another name


def param_slices(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, slice]]:
    """Each parameter with its name and its slice of the flat vector (the layout every peer shares:
    `model.named_parameters()` order, a tied tensor once)."""
    offset = 0
    for name, p in model.named_parameters():
        yield name, p, slice(offset, offset + p.numel())
        offset += p.numel()


def flat_params(model: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
    """The model's parameters as one fp32 CPU vector (the layout every peer shares), written into `out` if
    given. From a GPU, every tensor is copied into one pinned staging vector first (asynchronous copies, one
    wait), never through a list of per-tensor host copies concatenated afterwards."""
    params = list(param_slices(model))
    on_gpu = params[0][1].device.type == "cuda"
    if out is None:
        out = torch.empty(params[-1][2].stop, dtype=torch.float32, pin_memory=on_gpu and torch.cuda.is_available())
    with torch.no_grad():
        for _, p, part in params:
            out[part].view_as(p).copy_(p.detach(), non_blocking=on_gpu)
    if on_gpu:
        torch.cuda.current_stream(params[0][1].device).synchronize()
    return out


@torch.no_grad()
def load_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    end = 0
    for _, p, part in param_slices(model):
        p.copy_(flat[part].view_as(p))
        end = part.stop
    assert end == flat.numel(), "flat vector does not match the model"


def bitsandbytes():
    """The bitsandbytes module, or a ConfigError saying how to get it. Its import takes seconds and starts
    threads: a peer calls this while building, before its averager process and the DHT daemon start."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("--inner-optimizer adamw8bit needs bitsandbytes: pip install 'p2pdiloco[8bit]'") from None
    return bnb


def make_optimizer(params, cfg: InnerConfig) -> torch.optim.Optimizer:
    """The inner optimizer `cfg.optimizer` names, with the project's AdamW hyperparameters."""
    params = list(params)
    if cfg.optimizer == "adamw8bit":
        return bitsandbytes().optim.AdamW8bit(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                              weight_decay=cfg.weight_decay)
    # on a GPU, one fused kernel: it keeps ~0.1 GB less of the host's memory than the default multi-tensor AdamW
    # (CUDA loads fewer kernels for it: H200, 2026-11-28, docs/hardware.md), and launches fewer
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                             fused=fused or None)


def optimizer_state(optimizer: torch.optim.Optimizer, params) -> tuple[dict[str, torch.Tensor], dict]:
    """Every per-parameter state of the optimizer, as it is: tensors by `inner.{i}.{key}` (their own dtype,
    e.g. bitsandbytes' uint8 moments and their quantization maps and block maxima) and plain numbers by
    parameter index, so a restore is bit-exact whatever the optimizer keeps. A tensor several parameters share
    (bitsandbytes' quantization maps) is saved once; the others name it (`ALIAS` + key), and share it again."""
    tensors, scalars, seen = {}, {}, {}
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's own memory
                where = (local.data_ptr(), value.dtype, value.shape)
                shared = seen.get(where) if local.numel() else None
                if shared is not None:
                    scalars.setdefault(str(i), {})[ALIAS + key] = shared
                else:
                    seen[where] = f"inner.{i}.{key}"
                    tensors[f"inner.{i}.{key}"] = value.detach()  # on its device: the writer copies
            elif isinstance(value, (int, float, bool)):
                scalars.setdefault(str(i), {})[key] = value
    return tensors, scalars


def restore_optimizer_state(optimizer: torch.optim.Optimizer, params, tensors: dict[str, torch.Tensor],
                            scalars: dict, step: int = 0) -> None:
    params = list(params)
    if not any(k.startswith("inner.") for k in tensors):
        tensors = _from_format_one(tensors, params, step)
    loaded: dict[str, torch.Tensor] = {}
    for i, p in enumerate(params):
        prefix = f"inner.{i}."
        state = {}
        for name, t in tensors.items():
            if name.startswith(prefix):
                state[name[len(prefix):]] = loaded.setdefault(name, t.to(p.device))
        for key, value in scalars.get(str(i), {}).items():
            if key.startswith(ALIAS):
                state[key[len(ALIAS):]] = loaded.setdefault(value, tensors[value].to(p.device))
            else:
                state[key] = value
        if state:
            optimizer.state[p] = state


def _from_format_one(tensors: dict[str, torch.Tensor], params, step: int) -> dict[str, torch.Tensor]:
    """Checkpoints written before `inner.*` kept AdamW's moments as flat fp32 `adam.{i}.*` and no step."""
    out = {}
    for i, p in enumerate(params):
        if f"adam.{i}.exp_avg" in tensors and f"adam.{i}.exp_avg_sq" in tensors:
            out[f"inner.{i}.step"] = torch.tensor(float(step))
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"inner.{i}.{key}"] = tensors[f"adam.{i}.{key}"].view_as(p).to(p.dtype)
    return out


def _prepare_blocks(model: nn.Module, cfg: InnerConfig) -> None:
    """Activation checkpointing and compilation, block by block, where asked for."""
    if cfg.activation_checkpointing:
        if not hasattr(model, "checkpoint_blocks"):
            raise ConfigError(f"--activation-checkpointing: {type(model).__name__} cannot recompute its blocks")
        model.checkpoint_blocks = True
    if cfg.compile:
        if not hasattr(model, "compile_blocks"):
            raise ConfigError(f"--compile: {type(model).__name__} cannot compile its blocks")
        model.compile_blocks()


def _modules(model: nn.Module, cfg: InnerConfig, device: torch.device,
             ranks: Ranks | None) -> tuple[nn.Module | None, nn.Module]:
    """(θ whole as rank 0 reads and writes it, the module the steps train): `model` twice, or with --fsdp rank 0's
    model and a copy of it sharded over the ranks (the other ranks shard theirs, and keep no θ whole)."""
    if cfg.fsdp and ranks is None:
        raise ConfigError("--fsdp shards the model over a member's ranks: start it with torchrun "
                          "--nproc-per-node N (N > 1), or leave --fsdp out")
    if not cfg.fsdp:
        _prepare_blocks(model, cfg)
        return model, model
    trained = copy.deepcopy(model) if ranks.leads else model
    _prepare_blocks(trained, cfg)
    shard_model(trained, device)
    log.info("rank %d of %d holds %d of θ's %d parameters (FSDP2)", ranks.rank, ranks.world,
             sum(p.to_local().numel() for p in trained.parameters()), sum(p.numel() for p in trained.parameters()))
    return (model if ranks.leads else None), trained


class InnerTrainer:
    """Owns the local model and its AdamW state, which are kept across rounds (as DiLoCo prescribes)."""

    def __init__(self, model: nn.Module, batches: Iterator, cfg: InnerConfig, device: torch.device,
                 throttle: float = 1.0, ranks: Ranks | None = None, let_go_of_model=lambda: None):
        """`ranks`: this member's torchrun ranks (training.ranks), where it has more than one; with `cfg.fsdp`
        they shard the model (training.sharded), and `model` stays rank 0's θ whole (the mirror), whose pages
        `let_go_of_model()` drops once the shards took it (where it is parked: parts.held)."""
        self.batches, self.cfg, self.device, self.throttle = batches, cfg, device, throttle
        self.ranks, self.sharded = ranks, cfg.fsdp
        self.layout = Shards(let_go_of_model) if cfg.fsdp else Replicas()  # how the ranks hold θ (if several)
        self.lockstep = Lockstep() if ranks is not None and ranks.leads else None
        # θ as the swarm's side reads and writes it (rank 0); the module the steps train
        self.mirror, self.trained = _modules(model, cfg, device, ranks)
        self._behind = False  # with --fsdp: the shards took steps the mirror lacks
        self.total_steps, self.on_gpu = 0, device.type == "cuda"  # steps: over the peer's life
        self.optimizer = make_optimizer(self.trained.parameters(), cfg)
        if cfg.step_in_backward:
            for p in self.trained.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._step_one)
        self.forward = self.trained if ranks is None or cfg.fsdp else \
            data_parallel(self.trained, ranks, device, cfg.step_in_backward)

    @property
    def model(self) -> nn.Module:
        """θ, as rank 0 (or a peer of one) reads and writes it between steps. With --fsdp, the mirror, first
        brought up to date from the shards where they stepped since (every rank takes part)."""
        if self._behind:
            self.lockstep.gather(self, THETA)
            self._behind = False
        return self.mirror

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The inner optimizer's state (`optimizer_state`'s form), whole where it is sharded."""
        if not self.sharded:
            return optimizer_state(self.optimizer, self.trained.parameters())
        if self.layout.restored is not None:  # not dealt out yet (no step since): the shards do not hold it
            return self.layout.restored[0], self.layout.restored[1]
        tensors, scalars = self.lockstep.gather(self, EVERYTHING if self._behind else MOMENTS)
        self._behind = False
        return tensors, scalars

    def checkpoint_moments(self) -> tuple[dict, dict]:
        """The inner optimizer's state as a checkpoint keeps it: `optimizer_state`'s, or where the ranks shard it,
        a `ToStage` entry with which each rank writes its own part when the checkpoint is staged (rank 0 never
        holds it whole: 8 bytes a parameter with AdamW)."""
        if not self.sharded or self.layout.restored is not None:
            return self.optimizer_state()
        _, scalars = optimizer_state(self.optimizer, self.trained.parameters())  # rank 0's: every rank's alike
        return {SHARDS: ToStage(lambda folder: self.lockstep.save_shards(self, folder))}, scalars

    def restore_optimizer_state(self, tensors: dict, scalars: dict, step: int) -> None:
        """A checkpoint's optimizer state (whole, or the files of a sharded member's ranks, whatever their number):
        for the shards at the next step where they are sharded, else into this optimizer (a member's other ranks
        take it from rank 0's)."""
        shapes = [tuple(p.shape) for p in self.trained.parameters()]  # a shard's DTensor: its parameter's whole
        if self.sharded:
            if SHARDS in tensors:  # read by every rank at the next step: checked here, where a failure is one line
                saved_shapes(tensors[SHARDS].path, shapes)
            self.layout.restore(tensors, scalars, step)
        else:
            if SHARDS in tensors:
                tensors = dict(tensors, **whole_moments(tensors[SHARDS].path, shapes))
            restore_optimizer_state(self.optimizer, self.trained.parameters(), tensors, scalars, step=step)
        if self.lockstep is not None:
            self.lockstep.everything_written()

    def _step_one(self, param: nn.Parameter) -> None:
        """In the backward pass, once `param`'s gradient is complete. Every parameter whose gradient came
        before was stepped and its gradient freed, and those still to come have none yet: the optimizer's
        step (which skips parameters without a gradient) steps this one alone, as it would among all."""
        self.optimizer.step()
        param.grad = None

    def lr_at(self, progress: int) -> float:
        """The schedule's lr at `progress` tokens of the swarm (`training.schedule`)."""
        return inner_lr(self.cfg, progress, self.tokens_per_step)

    def release_ranks(self) -> None:
        """Rank 0 leaves: the member's other ranks stop training, once every rank's θ was found equal."""
        if self.lockstep is None:
            return
        try:
            self.lockstep.stop(self)
        except RanksDiverged:
            raise
        except RuntimeError as e:  # a rank is gone (gloo and NCCL say so as RuntimeErrors): torchrun ends the rest
            log.warning("could not tell the member's other ranks to stop (%s); torchrun stops them", e)

    def theta_written(self) -> None:
        """θ was changed outside an inner step (a round's rebase, a restore): the member's other ranks take it at
        the next step."""
        if self.lockstep is not None:
            self.lockstep.theta_written()

    def train_step(self, progress: int | None = None, lr: float | None = None) -> torch.Tensor:
        """One inner step at the lr of `progress`, the swarm's tokens (None: this trainer's own, as for a peer
        alone), or at `lr` (a rank following rank 0); the loss as a detached scalar tensor, still on the device
        (reading it syncs)."""
        if lr is None:
            lr = self.lr_at(self.total_steps * self.tokens_per_step if progress is None else progress)
        if self.lockstep is not None:
            self.lockstep.lead(self, lr)  # before the batch is drawn: the others draw theirs at our position
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = [self._micro_step(last=i == self.cfg.accumulate - 1) for i in range(self.cfg.accumulate)]
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if not self.cfg.step_in_backward:
            if self.cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(self.trained.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
        # freed now, not before the next backward: between steps, where a round's Δ, its outer step and the
        # checkpoints come and go, the gradients (4 bytes per parameter) are not held
        self.optimizer.zero_grad(set_to_none=True)
        self.total_steps += 1
        self._behind = self.sharded
        return loss

    def _micro_step(self, last: bool) -> torch.Tensor:
        """One micro-batch's forward and backward: its gradient, over `accumulate`, is added to the step's. DDP
        ranks average theirs at the last micro-batch only (no_sync before it); the loss, detached."""
        batch = next(self.batches)
        if self.on_gpu:
            batch = tuple(t.pin_memory() for t in batch)
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch)
        no_sync = getattr(self.forward, "no_sync", None)
        with nullcontext() if last or no_sync is None else no_sync():
            with torch.autocast("cuda", dtype=torch.bfloat16) if self.on_gpu else nullcontext():
                loss = self.forward(inputs, targets)
            # with step_in_backward (one micro-batch), this also steps every parameter (_step_one)
            (loss / self.cfg.accumulate if self.cfg.accumulate > 1 else loss).backward()
        return loss.detach()

    def timed_step(self, progress: int | None = None) -> tuple[torch.Tensor, float]:
        """One inner step; returns (loss, wall seconds). A throttled peer sleeps in proportion, so it behaves
        like a slower machine, and that sleep counts as step time (it stands for compute). On a GPU the seconds
        are those of queueing the step: over a window they add up to the device's time, as the queue is bounded."""
        start = time.perf_counter()
        loss = self.train_step(progress)
        elapsed = time.perf_counter() - start
        if self.throttle > 1.0:
            time.sleep(elapsed * (self.throttle - 1.0))
        return loss, time.perf_counter() - start

    @property
    def tokens_per_step(self) -> int:
        """The member's: every rank's micro-batches."""
        ranks = self.ranks.world if self.ranks is not None else 1
        return self.cfg.batch_size * self.cfg.accumulate * self.cfg.seq_len * ranks


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, device: torch.device, params: torch.Tensor | None = None,
             let_go: LetGo = hold) -> float:
    """Mean loss over `batches`. With `params` (a flat vector in `flat_params`' layout, e.g. Θ), the loss of
    those parameters, run through this model's modules on views of the vector: no second model (4 bytes per
    parameter) and no copy of the vector on a CPU. On a GPU the vector goes to the device a chunk at a time,
    `let_go` told each chunk once copied (a parked global state lets its host pages go)."""
    was_training = model.training
    model.eval()
    try:
        if params is None:
            losses = [model(x.to(device), y.to(device)).item() for x, y in batches]
        else:
            moved = _moved(params, device, let_go)
            views = parameter_views(model, moved)
            with _each_module_done(model, let_go) if moved is params else nullcontext():
                losses = [torch.func.functional_call(model, views, (x.to(device), y.to(device))).item()
                          for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


@contextmanager
def _each_module_done(model: nn.Module, let_go: LetGo):
    """While the forward pass reads a vector in place (Θ on the CPU), `let_go` is told each module's parameter
    slices once that module has run: a parked Θ lets their pages go as the pass moves on, instead of coming
    into memory whole for an evaluation (4 B/param, at the peak of a peer leaving: its final evaluation). A
    tied tensor's pages come back when it is read again; done is only ever about pages, never values."""
    where = {id(p): part for _, p, part in param_slices(model)}
    hooks = []
    for module in model.modules():
        parts = [where[id(p)] for p in module.parameters(recurse=False) if id(p) in where]
        if parts:
            hooks.append(module.register_forward_hook(functools.partial(_let_go, let_go, parts)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _let_go(let_go: LetGo, parts: list, *_) -> None:
    """A forward hook: returns None, so the module's output stands."""
    for part in parts:
        let_go(part)


def _moved(flat: torch.Tensor, device: torch.device, let_go: LetGo) -> torch.Tensor:
    if flat.device.type == torch.device(device).type:
        return flat.to(device)
    out = torch.empty_like(flat, device=device)
    for part in chunks(flat.numel()):
        out[part].copy_(flat[part])  # from pageable memory: done when it returns
        let_go(part)
    return out


def parameter_views(model: nn.Module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's parameters by name as views of a flat vector in `flat_params`' layout."""
    slices = list(param_slices(model))
    assert slices[-1][2].stop == flat.numel(), "flat vector does not match the model"
    return {name: flat[part].view_as(p) for name, p, part in slices}
