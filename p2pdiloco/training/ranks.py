"""One swarm member made of several local ranks (`torchrun --nproc-per-node N -m p2pdiloco.cli join ...`).

Rank 0 is the peer the swarm sees: it runs the helpers, the rounds, Θ and the checkpoints. Every rank trains,
its model wrapped in DistributedDataParallel (gloo on CPU, NCCL on GPUs), so the gradients are averaged over the
ranks at each inner step and θ stays identical on all of them. What only rank 0 does to θ between steps (a round's
rebase, a restore, an adopted state) reaches the others at the next step: before each step rank 0 broadcasts the
step's learning rate and data position, and θ whenever it wrote it (the first time, the inner optimizer's state
too). The member's data is one stream: step s of rank r reads batch s·N + r, so rank 0's stream position
resumes every rank. No network here beyond torch.distributed's own group.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from p2pdiloco.config import ConfigError

log = logging.getLogger("p2pdiloco")
LEADER = 0
STEP, STOP, GATHER = 0.0, 1.0, 2.0  # the command of a control message
# what comes after it (GATHER: what goes): nothing, θ, θ and the optimizer's state, or the optimizer's state; or
# (GATHER) the optimizer's state written by each rank, its own part, into a folder rank 0 names
SAME, THETA, EVERYTHING, MOMENTS, SHARDS = 0.0, 1.0, 2.0, 3.0, 4.0
RANK_WAIT = datetime.timedelta(hours=12)
CHECK_EVERY = 100  # inner steps between checks that every rank holds the same θ (a missed broadcast is a bug)


class RanksDiverged(RuntimeError):
    """A rank's θ differs from rank 0's: some write of θ was not sent (a bug; the member must not go on)."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int

    @property
    def leads(self) -> bool:
        return self.rank == LEADER


def follows_rank_0() -> bool:
    """This process is a rank other than 0 of a member torchrun started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != LEADER


def ranks_from_env(device: torch.device) -> Optional[Ranks]:
    """The ranks torchrun started us among (WORLD_SIZE > 1), their group joined; None for a peer of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if not dist.is_initialized():
        # the other ranks wait in a collective while rank 0 alone joins the swarm or downloads its state, which
        # over a slow link may take longer than torch's 30 minutes; a rank that dies is torchrun's to see
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=RANK_WAIT)
    return Ranks(dist.get_rank(), dist.get_world_size())


def rank_device(device: torch.device) -> torch.device:
    """A rank's own GPU (torchrun's LOCAL_RANK) where the member trains on GPUs."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # what a collective or a tensor made without a device uses
    return device


def data_parallel(model: nn.Module, ranks: Ranks, device: torch.device, step_in_backward: bool) -> nn.Module:
    """The model as the inner steps call it: averaged gradients over the member's ranks."""
    if step_in_backward:  # its hooks would step each parameter on this rank's gradient, before the average
        raise ConfigError("--step-in-backward steps on this rank's own gradient: it cannot be used with torchrun's "
                          "ranks (leave it out, or run one rank)")
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                               forward_sync_buffers=False)  # equal on every rank (RoPE)


class Strided:
    """The member's one batch stream, dealt out to its ranks: rank r's step s reads batch s·N + r. `position`
    counts the member's steps, so a checkpoint of rank 0's position resumes every rank."""

    def __init__(self, stream, ranks: Ranks):
        self.stream, self.ranks = stream, ranks
        self.position = stream.position // ranks.world

    @property
    def seed(self) -> int:
        return self.stream.seed

    @seed.setter
    def seed(self, value: int) -> None:  # a restore, or a rank other than 0 learning the member's stream
        self.stream.seed = value

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        self.stream.position = self.position * self.ranks.world + self.ranks.rank
        self.position += 1
        return next(self.stream)

    def where(self):
        return self.stream.where() if hasattr(self.stream, "where") else None


class Lockstep:
    """Rank 0's side: `lead` before each inner step; `theta_written` whenever θ changes outside a step; `gather`
    where θ is sharded and rank 0 reads it."""

    def __init__(self):
        self.writes, self.sent = 0, -1  # nothing sent yet: the first step sends θ and the optimizer's state

    def theta_written(self) -> None:
        self.writes += 1

    def everything_written(self) -> None:
        """A restore: the optimizer's state goes to the ranks too, at the next step."""
        self.writes, self.sent = self.writes + 1, -1

    def lead(self, trainer, lr: float) -> None:
        self._send(STEP, trainer, lr, check=trainer.total_steps % CHECK_EVERY == 0)

    def gather(self, trainer, what: float):
        """Where θ is sharded: the ranks' shards of θ (THETA) whole into rank 0's mirror, or of the optimizer's
        state (MOMENTS, returned), or both (EVERYTHING). Every rank takes part."""
        send_control(GATHER, what, False, trainer.batches.position, 0.0, trainer.device)
        return trainer.layout.gather(trainer, what)

    def save_shards(self, trainer, folder) -> None:
        """Where θ is sharded: each rank writes its part of the optimizer's state into `folder`. Every rank takes
        part."""
        send_control(GATHER, SHARDS, False, trainer.batches.position, 0.0, trainer.device)
        trainer.layout.gather(trainer, SHARDS, folder)

    def stop(self, trainer) -> None:
        """The member leaves: the other ranks leave their loop, once every rank's θ was found equal."""
        self._send(STOP, trainer, 0.0, check=True)
        leave_group(trainer)

    def _send(self, command: float, trainer, lr: float, check: bool) -> None:
        sends = SAME if self.writes == self.sent else EVERYTHING if self.sent < 0 else THETA
        send_control(command, sends, check, trainer.batches.position, lr, trainer.device)
        if sends != SAME:
            send_state(trainer, everything=sends == EVERYTHING)
            self.sent = self.writes
        if check:
            trainer.layout.check(trainer)


def send_control(command: float, sends: float, check: bool, position: int, lr: float, device: torch.device) -> None:
    """On the ranks' device: NCCL moves only GPU tensors."""
    control = torch.tensor([command, sends, float(check), float(position), lr], dtype=torch.float64, device=device)
    dist.broadcast(control, LEADER)


def send_state(trainer, everything: bool) -> None:
    """θ from rank 0 to all (and with `everything`, the inner optimizer's state, its step and the stream's seed: a
    restored rank 0's)."""
    if everything:
        box = [dict(step=trainer.total_steps, seed=trainer.batches.seed)]
        dist.broadcast_object_list(box, LEADER)
        trainer.total_steps = box[0]["step"]
        trainer.batches.seed = box[0]["seed"]
    trainer.layout.share(trainer, everything)


class Replicas:
    """How a DDP member's ranks keep θ: each whole (`InnerTrainer.layout`; `sharded.Shards` is FSDP's, which also
    gathers θ for rank 0 and holds a restored optimizer state until the next share: a replica needs neither)."""

    def share(self, trainer, everything: bool) -> None:
        from p2pdiloco.training.inner import optimizer_state, restore_optimizer_state  # inner imports this module

        params = list(trainer.trained.parameters())
        if everything:
            moments, scalars = optimizer_state(trainer.optimizer, params) if dist.get_rank() == LEADER else ({}, {})
            box = [dict(scalars=scalars, shapes={k: (tuple(v.shape), v.dtype) for k, v in moments.items()})]
            dist.broadcast_object_list(box, LEADER)
            meta = box[0]
            if dist.get_rank() != LEADER:
                moments = {k: torch.empty(shape, dtype=dtype, device=params[0].device)
                           for k, (shape, dtype) in meta["shapes"].items()}
            for name in sorted(moments):
                dist.broadcast(moments[name], LEADER)
            if dist.get_rank() != LEADER:
                restore_optimizer_state(trainer.optimizer, params, moments, meta["scalars"], trainer.total_steps)
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, LEADER)

    def check(self, trainer) -> None:
        check_same(trainer.trained)


def check_same(model) -> None:
    """Every rank's θ, hashed to two float64 sums, against rank 0's."""
    with torch.no_grad():
        flat = [p.detach().double().reshape(-1) for p in model.parameters()]
        mine = torch.stack([sum(f.sum() for f in flat), sum((f * f).sum() for f in flat)])
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if any(not torch.equal(other, everyone[LEADER]) for other in everyone):
        raise RanksDiverged(f"ranks hold different θ: {[t.tolist() for t in everyone]}")


def leave_group(trainer) -> None:
    """Every rank, last: a barrier, so that gloo's worker thread has dropped the tensors of the collectives before
    (it frees them under the GIL, which the thread tearing the group down holds: seen to deadlock at exit), then
    the model without its DDP wrapper, and the group."""
    dist.barrier()
    trainer.forward = trainer.trained
    dist.destroy_process_group()


def follow(trainer) -> int:
    """A rank other than 0: train each step rank 0 announces, taking θ when it sends it, until it stops.
    Returns the steps trained."""
    steps = 0
    while True:
        control = torch.zeros(5, dtype=torch.float64, device=trainer.device)
        dist.broadcast(control, LEADER)
        command, sends, check, position, lr = control.tolist()
        if command == GATHER:
            trainer.layout.gather(trainer, sends)
            continue
        if sends != SAME:
            send_state(trainer, everything=sends == EVERYTHING)
        trainer.batches.position = int(position)
        if check:
            trainer.layout.check(trainer)
        if command == STOP:
            leave_group(trainer)
            return steps
        trainer.train_step(lr=lr)
        steps += 1
