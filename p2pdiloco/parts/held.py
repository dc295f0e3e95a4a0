"""The model-sized tensors: θ (the model) and Θ with its momentum (the global state). Built only once the helper
processes forked: a child forked after them keeps its own copy of every page the trainer writes afterwards
(copy-on-write), which cost about 12 bytes per parameter across the two helpers (the 100M model, measured)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from p2pdiloco.config import PeerConfig
from p2pdiloco.core.state import GlobalState
from p2pdiloco.parts.workload import Workload, parking_folder
from p2pdiloco.runtime.heap import give_back_free_heap
from p2pdiloco.runtime.paging import FileVectors
from p2pdiloco.training.inner import flat_params
from p2pdiloco.training.model import build_model
from p2pdiloco.training.parked import Held, Parked, global_vectors, parked_parameters

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Tensors:
    model: torch.nn.Module
    vectors: Held | Parked  # where Θ and the momentum live: memory, or files (training.parked)
    state: GlobalState
    mirror: Optional[FileVectors] = None  # with --fsdp and the state on disk: where the model's θ lives

    def let_go_of_model(self) -> None:
        """With --fsdp, rank 0's model is a copy of θ read and written only between steps: where it is parked,
        its pages go (a no-op otherwise)."""
        if self.mirror is not None:
            self.mirror.let_go()

    def park(self, give_back: bool = True) -> None:
        """Θ and the momentum are cold until a round starts or ends, an evaluation, a checkpoint or a joiner
        reads them (nothing to do where they are kept in memory). What the round's work freed goes back to the
        kernel too (`runtime.heap`), unless `give_back` is False."""
        self.vectors.let_go()
        self.let_go_of_model()
        if give_back:
            give_back_free_heap()


def materialize(cfg: PeerConfig, workload: Workload) -> Tensors:
    # with --fsdp this is rank 0's mirror of θ, kept in host memory: the device holds only this rank's shard
    model = build_model(workload.model_config, cfg.seed, cfg.init_from).to(
        torch.device("cpu") if cfg.inner.fsdp else workload.device)
    folder = parking_folder(cfg, workload.n_params)
    if folder is not None and cfg.global_state_on_disk is None:  # chosen for the user: say so, and how to undo it
        log.info("the global state (%.2f GB) waits in files under %s while not in use, as this machine's memory "
                 "suggests (--no-global-state-on-disk keeps it in memory)", 8 * workload.n_params / 1e9, folder)
    vectors = global_vectors(workload.n_params, folder)
    theta = flat_params(model, out=vectors.theta)  # no staging copy beside it, from a GPU either
    state = GlobalState(theta, cfg.outer.lr, cfg.outer.momentum, storage=(theta, vectors.momentum),
                        let_go=vectors.let_go)
    mirror = parked_parameters(model, folder) if cfg.inner.fsdp and folder is not None else None
    tensors = Tensors(model, vectors, state, mirror)
    tensors.park()
    return tensors


class SharedState:
    """What the averager serves a peer asking for our state (hivemind advertises it from the averager's start,
    before our state is built: such a peer is told so, and asks another donor)."""

    def __init__(self):
        self.tensors: Optional[Tensors] = None  # set once, as soon as they exist

    def __call__(self):
        if self.tensors is None:
            raise RuntimeError("this peer is still starting: no state to share yet")
        try:
            return self.tensors.state.snapshot(shared=True)
        finally:
            self.tensors.park()
