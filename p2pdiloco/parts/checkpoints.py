"""A peer's own checkpoints: saved between rounds, found and restored at start."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from p2pdiloco.config import PeerConfig
from p2pdiloco.parts.workload import Workload
from p2pdiloco.runtime import schema
from p2pdiloco.training import checkpoint
from p2pdiloco.training.diloco import DiLoCo

log = logging.getLogger("p2pdiloco")
# timed checkpoints by default: 60 times the last write apart (under 2% of the time; measured with
# scripts/bench/bench_checkpoint.py), and at least this often apart
AUTO_FACTOR, AUTO_FLOOR = 60.0, 30.0


def checkpoint_folder(cfg: PeerConfig, name: str) -> Path:
    return cfg.checkpoint_dir / cfg.swarm.run_id / name


def is_ours(cfg: PeerConfig, meta: dict) -> bool:
    return meta.get("run_id") == cfg.swarm.run_id and meta.get("model") == cfg.model


def resumes_warm(cfg: PeerConfig) -> bool:
    """A named peer with a checkpoint of this run trains from it while it connects (`parts.joining`). Only the
    metadata is read now: the tensors come after the helper processes fork, which would otherwise keep a copy of
    every page of them that we free or write afterwards."""
    meta = checkpoint.latest_meta(checkpoint_folder(cfg, cfg.name)) if cfg.name else None
    return bool(meta and is_ours(cfg, meta) and "stream_seed" in meta and cfg.swarm.initial_peers)


class Checkpoints:
    def __init__(self, cfg: PeerConfig, workload: Workload, name: str, metrics):
        self.cfg, self.workload, self.name, self.metrics = cfg, workload, name, metrics
        self.folder = checkpoint_folder(cfg, name)
        self.error: Optional[str] = None  # the last write failed: why, and what to do
        self.saved_at = time.monotonic()  # the last save (or start): timed saves count from it
        self.write_seconds = 0.0  # the last write's duration: the default interval follows it

    @property
    def timed(self) -> bool:
        """Timed saves are on (--checkpoint-seconds; by default unless --checkpoint-every 0 said never)."""
        every = self.cfg.checkpoint_seconds
        return bool(self.cfg.checkpoint_every) if every is None else every > 0

    def interval(self) -> float:
        every = self.cfg.checkpoint_seconds
        return every if every is not None else max(AUTO_FLOOR, AUTO_FACTOR * self.write_seconds)

    def due(self) -> bool:
        return self.timed and time.monotonic() - self.saved_at >= self.interval()

    def save(self, diloco: DiLoCo, why: str) -> None:
        if not diloco.can_checkpoint:
            return  # an eager round in flight (see DiLoCo.checkpoint_state)
        started = self.saved_at = time.monotonic()  # a failed write is not retried at every step
        cfg, workload = self.cfg, self.workload
        meta, tensors = diloco.checkpoint_state()
        meta.update(model=cfg.model, n_params=workload.n_params, run_id=cfg.swarm.run_id, why=why,
                    model_config=workload.model_config.to_dict(),
                    tokenizer_sha256=workload.data.tokenizer_fingerprint, data_sha256=workload.data.fingerprint)
        self._keep_tokenizer()
        try:
            path = checkpoint.save(self.folder, meta, tensors, keep=cfg.keep_checkpoints)
        except checkpoint.CheckpointWriteError as e:  # the write is undone, the checkpoints already saved stay
            newest = checkpoint.list_checkpoints(self.folder)
            self.error = (
                f"could not write a checkpoint to {self.folder} ({e}); "
                f"{'the newest saved one, ' + newest[0].name + ', is kept' if newest else 'none was saved before'}:"
                f" free space there or give --checkpoint-dir another disk")
            log.error("%s: %s", self.name, self.error)
            return
        self.error, self.write_seconds = None, time.monotonic() - started
        self.metrics.write(schema.Checkpoint(peer=self.name, version=meta["version"], path=str(path), why=why,
                                             seconds=self.write_seconds))

    def note_contribution(self, diloco: DiLoCo, c) -> None:
        """Each contribution as it leaves: should we die before the next checkpoint, the restart knows that the
        newest one's unmerged progress went out in it (`DiLoCo.unsettled`). A failed write costs that knowledge
        only: the restart then rebases the progress as before."""
        try:
            checkpoint.note_contribution(self.folder, c, diloco.trainer.total_steps,
                                         getattr(diloco.trainer.batches, "position", None))
        except OSError as e:
            log.warning("%s: could not note the contribution in %s: %s", self.name, self.folder, e)

    def _keep_tokenizer(self) -> None:
        """The tokenizer beside our checkpoints, once: `p2pdiloco export` and `sample` read it from there."""
        folder = self.folder / checkpoint.TOKENIZER_DIR
        if not (folder / "tokenizer.json").is_file():
            try:
                self.workload.data.tokenizer.save_pretrained(str(folder))
            except OSError as e:
                log.warning("%s: could not keep the tokenizer in %s: %s", self.name, folder, e)

    def resume(self, diloco: DiLoCo) -> None:
        """Restore the newest of our checkpoints that is whole and of this run, if any."""
        found = checkpoint.load_latest(self.folder, self.workload.n_params, report=log.warning)
        if found is None:
            return
        if not is_ours(self.cfg, found.meta):
            log.warning("%s: ignoring checkpoint %s: it is of run %r, model %r", self.name, found.path,
                        found.meta.get("run_id"), found.meta.get("model"))
            return
        note = diloco.restore_checkpoint_state(found.meta, found.tensors, checkpoint.last_contribution(self.folder))
        # copied into the model, Θ and the optimizer: free the loaded tensors now rather than keep them beside
        # the model for the whole run
        found.tensors.clear()
        if note:
            log.warning("%s: %s", self.name, note)
        state = diloco.state
        log.info("%s: resumed from checkpoint %s (version %d)", self.name, found.path, state.version)
        self.metrics.write(schema.Restore(peer=self.name, version=state.version, digest=state.digest,
                                          path=str(found.path), inner_step=diloco.trainer.total_steps))
