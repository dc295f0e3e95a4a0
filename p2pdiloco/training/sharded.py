"""FSDP2 inside one member (`--fsdp` under torchrun): each rank holds 1/N of θ, of its gradients and of the AdamW
moments (`fully_shard` on every transformer block, then on the whole model): a model whose training state does not
fit one device (or one process) trains over N.

The swarm's side is unchanged: rank 0 keeps θ whole in a plain copy of the model (the *mirror*, in host memory),
and everything that reads or writes θ between steps (the pseudo-gradient, a round's rebase, a checkpoint, a
restore) works on it. The mirror is brought up to date from the shards only when rank 0 reads θ after a step
(`gather_theta`: every rank takes part), and a write to it reaches the shards before the next step
(`scatter_theta`, from rank 0). A checkpoint holds θ whole and the moments as each rank holds them, a file per rank
(torch.distributed.checkpoint, `save_moments`): rank 0 never holds them whole, and they are re-sharded on load, so a
member resumes with any number of ranks, or as a single process (`whole_moments`). No network here beyond
torch.distributed's own group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from p2pdiloco.config import ConfigError
from p2pdiloco.training.checkpoint import SHARDS as SHARDS_ENTRY, CheckpointError, CheckpointWriteError
from p2pdiloco.training.ranks import EVERYTHING, LEADER, MOMENTS, SHARDS, THETA

log = logging.getLogger("p2pdiloco")


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """`model`, in place, as the inner steps train it: its blocks and then the whole of it sharded over every
    rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not hasattr(model, "blocks"):
        raise ConfigError(f"--fsdp: {type(model).__name__} names no repeated blocks to shard")
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # what no block holds: the embeddings, the last norm, the head
    return model


class Shards:
    """How a sharded member's ranks keep θ: each its part (`InnerTrainer.layout`; `ranks.Replicas` is DDP's)."""

    def __init__(self, let_go_of_mirror=lambda: None):
        self.let_go_of_mirror = let_go_of_mirror  # rank 0: where the mirror is parked, its pages go after a share
        self.restored: Optional[tuple[dict[str, torch.Tensor], dict, int]] = None  # rank 0: for the next share

    def restore(self, tensors: dict[str, torch.Tensor], scalars: dict, step: int) -> None:
        """Rank 0: the optimizer state from a checkpoint (whole, or the ranks' files of it), dealt out to the ranks
        at the next step."""
        self.restored = ({k: v for k, v in tensors.items() if k.startswith("inner.") or k == SHARDS_ENTRY}, scalars,
                         step)

    def share(self, trainer, everything: bool) -> None:
        """Every rank: rank 0's θ (and with `everything`, what it restored of the optimizer) into the shards."""
        scatter_theta(trainer.trained, trainer.mirror)
        if everything:
            scatter_moments(trainer.optimizer, trainer.trained, self.restored)
            self.restored = None
        self.let_go_of_mirror()

    def gather(self, trainer, what: float, folder: Optional[Path] = None) -> Optional[tuple[dict, dict]]:
        """Every rank: θ whole into rank 0's mirror (THETA), the optimizer's state whole (MOMENTS, returned), or
        both (EVERYTHING); or each rank's part of the optimizer's state into rank 0's `folder` (SHARDS)."""
        if what == SHARDS:
            box = [str(folder) if folder is not None else None]
            dist.broadcast_object_list(box, LEADER)
            save_moments(trainer.optimizer, trainer.trained, Path(box[0]))
            if dist.get_rank() == LEADER:
                written_by_every_rank(Path(box[0]), dist.get_world_size())
            return None
        if what in (THETA, EVERYTHING):
            gather_theta(trainer.trained, trainer.mirror)
        return gather_moments(trainer.optimizer, trainer.trained) if what in (MOMENTS, EVERYTHING) else None

    def check(self, trainer) -> None:
        """Nothing to compare: no two ranks hold the same part of θ."""


def _pairs(trained: nn.Module, mirror: Optional[nn.Module]):
    """(shard, the mirror's parameter or None) by name: the same order on every rank."""
    whole = dict(mirror.named_parameters()) if mirror is not None else {}
    for name, p in trained.named_parameters():
        if mirror is not None and name not in whole:
            raise RuntimeError(f"the sharded model has a parameter the mirror lacks: {name}")
        yield p, whole.get(name)


@torch.no_grad()
def gather_theta(trained: nn.Module, mirror: Optional[nn.Module]) -> None:
    """Every rank: θ whole into rank 0's mirror (a parameter at a time: one parameter's all-gather in flight)."""
    for p, whole in _pairs(trained, mirror):
        full = p.full_tensor()
        if whole is not None:
            whole.copy_(full)


@torch.no_grad()
def scatter_theta(trained: nn.Module, mirror: Optional[nn.Module]) -> None:
    """Every rank: each its shard of rank 0's mirror."""
    for p, whole in _pairs(trained, mirror):
        p.copy_(_shard_of(whole, p))


def _shard_of(whole: Optional[torch.Tensor], like) -> torch.Tensor:
    """`whole` (rank 0's; None elsewhere) dealt out as `like`'s shards, from rank 0."""
    from torch.distributed.tensor import distribute_tensor

    local = like.to_local()
    if whole is None:
        whole = torch.empty(like.shape, dtype=local.dtype, device=local.device)
    return distribute_tensor(whole.to(local.device, local.dtype), like.device_mesh, like.placements,
                             src_data_rank=LEADER)


def gather_moments(optimizer: torch.optim.Optimizer, trained: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """Every rank: the inner optimizer's state whole, as `inner.optimizer_state` names it, on rank 0 (for a
    checkpoint: 8 bytes per parameter with AdamW while it is written); empty on the others."""
    from torch.distributed.tensor import DTensor

    from p2pdiloco.training.inner import optimizer_state  # inner imports this module

    tensors, scalars = optimizer_state(optimizer, trained.parameters())
    whole = {}
    for name, value in tensors.items():  # one tensor at a time whole on the other ranks: they keep none of it
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if dist.get_rank() == LEADER:
            whole[name] = full
    return whole, scalars


def scatter_moments(optimizer: torch.optim.Optimizer, trained: nn.Module,
                    restored: Optional[tuple[dict, dict, int]]) -> None:
    """Every rank: each its shards of the optimizer state rank 0 restored (`restored`: its moments whole, or the
    ranks' files of them, scalars and step; None elsewhere, and on rank 0 where it restored nothing)."""
    from p2pdiloco.training.inner import restore_optimizer_state  # inner imports this module

    tensors, scalars, step = restored if restored is not None else ({}, {}, None)
    files = tensors.get(SHARDS_ENTRY)
    tensors = {k: v for k, v in tensors.items() if k != SHARDS_ENTRY}
    box = [dict(shapes={k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, scalars=scalars, step=step,
                folder=str(files.path) if files is not None else None)]
    dist.broadcast_object_list(box, LEADER)
    meta = box[0]
    if meta["step"] is None:
        return
    if meta["folder"] is not None:  # each rank reads its own part of them, whatever the ranks that wrote them
        try:
            load_moments(optimizer, trained, Path(meta["folder"]), meta["scalars"], meta["step"])
        except CheckpointError as e:  # on every rank alike: DCP's read fails on all of them if one fails
            start_moments_afresh(optimizer, e)
        return
    params = list(trained.parameters())
    mine = {}
    for name in sorted(meta["shapes"]):
        shape, dtype = meta["shapes"][name]
        p = params[int(name.split(".")[1])]  # inner.{i}.{key}
        if shape == tuple(p.shape):  # a moment: sharded as its parameter is
            mine[name] = _shard_of(tensors.get(name), p)
        else:  # a scalar (AdamW's step): the same on every rank
            device = p.to_local().device
            value = tensors[name].to(device) if name in tensors else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(value, LEADER)
            mine[name] = value
    restore_optimizer_state(optimizer, params, mine, meta["scalars"], step=meta["step"])


# what DCP's metadata names besides the classes of torch.distributed.checkpoint.metadata, torch.Size and dtypes (a
# torch release that pickles others is refused, and tests/unit/test_rank_shards.py, which reads real files, fails)
METADATA_ALSO = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
                 ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." not in name:
            if module == "torch.distributed.checkpoint.metadata":
                found = getattr(sys.modules[module], name, None)
                if isinstance(found, type) and found.__module__ == module:
                    return found
            if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
                return getattr(torch, name)
            if (module, name) in METADATA_ALSO:
                return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no checkpoint's metadata holds")


def checked_reader(folder: Path):
    """torch.distributed.checkpoint's reader of `folder` (FileSystemReader, whose `read_metadata` torch's own
    readers override too) that unpickles the folder's `.metadata` with only the classes DCP's metadata is made of,
    where its `pickle.load` would run whatever a crafted file names, and reads only files in the folder."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            try:
                with open(Path(folder) / ".metadata", "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
                raise CheckpointError(f"{folder}: the ranks' optimizer state has unreadable metadata ({e})") from None
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"{folder}: the ranks' optimizer state has unreadable metadata (not DCP's)")
            names = [getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()]
            if not all(isinstance(name, str) and name and Path(name).name == name for name in names):
                raise CheckpointError(f"{folder}: the ranks' optimizer state names files outside its folder")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(folder)


def save_moments(optimizer: torch.optim.Optimizer, trained: nn.Module, folder: Path) -> None:
    """Every rank: its part of the optimizer's state into `folder`, as `inner.optimizer_state` names it, a file
    per rank (torch.distributed.checkpoint; a plain tensor every rank holds alike, AdamW's step, is written once).
    A rank's failed write (a full disk) fails it on every rank alike (DCP's CheckpointException, after the same
    collectives on all): rank 0 raises CheckpointWriteError, one line, and the others go on training."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from p2pdiloco.training.inner import optimizer_state  # inner imports this module

    tensors, _ = optimizer_state(optimizer, trained.parameters())
    try:
        dcp.save(tensors, checkpoint_id=folder)
    except CheckpointException as e:  # a BaseException: it would pass every `except Exception` on the way up
        failures = each_rank(e)
        if dist.get_rank() == LEADER:
            raise CheckpointWriteError(f"a rank could not write its part of the optimizer state ({failures})") \
                from None
        log.warning("could not write this rank's part of a checkpoint (%s); rank 0 reports it", failures)


def written_by_every_rank(folder: Path, world: int) -> None:
    """Rank 0, after `save_moments`: a file of every rank in `folder`. A rank on another machine writes its part
    on that machine's disk, where rank 0's checkpoint would never find it."""
    found = len(list(folder.glob("*.distcp")))
    if found != world:
        raise CheckpointWriteError(f"{found} of the member's {world} ranks wrote their part of the optimizer state "
                                   f"into {folder}: a member's ranks must share the checkpoint folder's disk")


def load_moments(optimizer: torch.optim.Optimizer, trained: nn.Module, folder: Path, scalars: dict,
                 step: int) -> None:
    """Every rank: its part of the optimizer's state that `save_moments` wrote, by any number of ranks (each
    moment sharded as its parameter is now), into this optimizer."""
    import torch.distributed.checkpoint as dcp

    from p2pdiloco.training.inner import restore_optimizer_state  # inner imports this module

    params = list(trained.parameters())
    mine = {}
    for name, (shape, dtype) in saved_shapes(folder, [tuple(p.shape) for p in params]).items():
        p = params[int(name.split(".")[1])]  # inner.{i}.{key}
        if shape == tuple(p.shape):  # a moment: sharded as its parameter is
            mine[name] = torch.zeros_like(p, dtype=dtype)
        else:  # a scalar (AdamW's step)
            mine[name] = torch.zeros(shape, dtype=dtype, device=p.to_local().device)
    with read_as_checkpoint_error(folder):
        dcp.load(mine, storage_reader=checked_reader(folder))
    restore_optimizer_state(optimizer, params, mine, scalars, step=step)


def whole_moments(folder: Path, shapes: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The optimizer's state that `save_moments` wrote, whole, in this process alone (a single process, or a
    replicated member's rank 0, resuming from a sharded member's checkpoint), for parameters of `shapes`."""
    import torch.distributed.checkpoint as dcp

    whole = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in saved_shapes(folder, shapes).items()}
    with warnings.catch_warnings():  # that it reads in one process is what no_dist asks, not news
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        with read_as_checkpoint_error(folder):
            dcp.load(whole, storage_reader=checked_reader(folder), no_dist=True)
    return whole


def start_moments_afresh(optimizer: torch.optim.Optimizer, why: CheckpointError) -> None:
    """Every rank: a fresh optimizer, where the ranks could not read their parts of a checkpoint that passed its
    checks (its files hash as recorded: written wrong, or by a torch whose format this one does not read). θ, Θ and
    the counters came from it whole, so the member trains on and loses only the moments; ending here instead, every
    restart would meet the same checkpoint."""
    optimizer.state.clear()
    if dist.get_rank() == LEADER:
        log.warning("%s: the inner optimizer's moments start afresh", why)


def each_rank(e) -> str:
    """What a DCP CheckpointException says went wrong, rank by rank, on one line."""
    return "; ".join(f"rank {rank}: {error!r}" for rank, (error, _) in sorted(e.failures.items()))


@contextlib.contextmanager
def read_as_checkpoint_error(folder: Path):
    """DCP's failed read (a CheckpointException, a BaseException that every `except Exception` lets by) as a
    CheckpointError of one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        raise CheckpointError(f"{folder}: the ranks' optimizer state could not be read ({each_rank(e)})") from None


def saved_shapes(folder: Path, shapes: list[tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor `save_moments` wrote into `folder`: its whole shape and dtype, each a moment of one of the
    parameters of `shapes` (`inner.{i}.{key}`: parameter i's shape) or a number (AdamW's step); CheckpointError
    for anything else, before a tensor of it is made."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = checked_reader(folder).read_metadata().state_dict_metadata
    found = {}
    for name, meta in saved.items():
        parts = name.split(".") if isinstance(name, str) else []
        fits = isinstance(meta, TensorStorageMetadata) and len(parts) == 3 and parts[0] == "inner" \
            and parts[1].isdigit() and int(parts[1]) < len(shapes)
        shape = tuple(meta.size) if fits else ()
        if not fits or not meta.properties.dtype.is_floating_point or \
                (shape != shapes[int(parts[1])] and math.prod(shape) > 1):
            raise CheckpointError(f"{folder}: the ranks' optimizer state does not fit this model ({name!r})")
        found[name] = (shape, meta.properties.dtype)
    return found
