"""A peer's own checkpoints: saved between rounds, found and restored at start."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from p2pdiloco.config import CHECKPOINT_FACTOR, CHECKPOINT_FLOOR, ConfigError, PeerConfig
from p2pdiloco.core.state import StateChanged
from p2pdiloco.parts.workload import Workload
from p2pdiloco.protocol.outcomes import Committed, Solo
from p2pdiloco.runtime import schema
from p2pdiloco.training import checkpoint
from p2pdiloco.training.diloco import DiLoCo

log = logging.getLogger("p2pdiloco")


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


@dataclass
class Write:
    """One checkpoint on its way to disk, and how that went."""
    meta: dict
    why: str
    guard: Callable  # held while Θ is written: raises StateChanged if a round changed it since `meta`
    path: Optional[Path] = None
    error: Optional[str] = None  # the disk said no
    superseded: bool = False
    failure: Optional[BaseException] = None
    seconds: float = 0.0
    stall_seconds: float = 0.0  # the training thread's part


class Checkpoints:
    def __init__(self, cfg: PeerConfig, workload: Workload, name: str, metrics):
        self.cfg, self.workload, self.name, self.metrics = cfg, workload, name, metrics
        self.folder = checkpoint_folder(cfg, name)
        self.error: Optional[str] = None  # the last write failed: why, and what to do
        self.saved_at = time.monotonic()  # the last save (or start): timed saves count from it
        self.write_seconds = 0.0  # the last write's duration: the default interval follows it
        self.writing: Optional[tuple[threading.Thread, Write]] = None  # a background write, until reported
        background = cfg.checkpoint_background
        self.background = workload.device.type == "cuda" if background is None else background

    @property
    def timed(self) -> bool:
        """Timed saves are on (--checkpoint-seconds; by default unless --checkpoint-every 0 said never)."""
        every = self.cfg.checkpoint_seconds
        return bool(self.cfg.checkpoint_every) if every is None else every > 0

    def interval(self) -> float:
        every = self.cfg.checkpoint_seconds
        return every if every is not None else max(CHECKPOINT_FLOOR, CHECKPOINT_FACTOR * self.write_seconds)

    def due(self) -> bool:
        return self.timed and time.monotonic() - self.saved_at >= self.interval()

    def save(self, diloco: DiLoCo, why: str, wait: bool = False) -> None:
        """Checkpoint now. θ and the inner optimizer's state are copied on this (the training) thread and written
        by another, which holds Θ only while it writes it (`--checkpoint-background`); `wait`: written here and
        now, after any write still going (leaving). A save while the last one is still being written is
        skipped."""
        if not diloco.can_checkpoint:
            return  # an eager round in flight (see DiLoCo.checkpoint_state)
        self.collect(wait=wait)
        if self.writing is not None:
            return
        started = self.saved_at = time.monotonic()  # a failed write is not retried at every step
        meta, tensors = self._state(diloco, why)
        job = Write(meta, why, diloco.checkpoint_guard())
        try:  # a sharded member's ranks write their parts of the optimizer's state now, on this thread
            tensors = checkpoint.stage(tensors, self.folder)
        except checkpoint.CheckpointWriteError as e:
            job.error = str(e)
            self._report(job)
            return
        if wait or not self.background:
            self._write(job, tensors)
            job.stall_seconds = time.monotonic() - started
            self._report(job)
            return
        tensors = checkpoint.host_copies(tensors)  # the stall the training thread pays: a copy, not a write
        job.stall_seconds = time.monotonic() - started
        thread = threading.Thread(target=self._write, args=(job, tensors), name=f"checkpoint-{why}", daemon=True)
        self.writing = (thread, job)
        thread.start()

    def collect(self, wait: bool = False) -> None:
        """Report a background write once it has finished (here, on the training thread, which owns the
        metrics); `wait`: until it has."""
        if self.writing is None:
            return
        thread, job = self.writing
        if wait:
            thread.join()
        if not thread.is_alive():
            self.writing = None
            self._report(job)

    def _state(self, diloco: DiLoCo, why: str) -> tuple[dict, dict]:
        cfg, workload = self.cfg, self.workload
        meta, tensors = diloco.checkpoint_state()
        meta.update(model=cfg.model, n_params=workload.n_params, run_id=cfg.swarm.run_id, why=why,
                    model_config=workload.model_config.to_dict(),
                    tokenizer_sha256=workload.data.tokenizer_fingerprint, data_sha256=workload.data.fingerprint)
        self._keep_tokenizer()
        return meta, tensors

    def _write(self, job: "Write", tensors: dict) -> None:
        """On any thread: touches only the files, and `job`."""
        started = time.monotonic()
        try:
            job.path = checkpoint.save(self.folder, job.meta, tensors, keep=self.cfg.keep_checkpoints,
                                       guard=job.guard)
        except checkpoint.CheckpointWriteError as e:  # the write is undone, the checkpoints already saved stay
            job.error = str(e)
        except StateChanged:  # a round changed Θ before the writer could read it: θ no longer goes with it
            job.superseded = True
        except BaseException as e:  # a fault of ours: raised again on the training thread
            job.failure = e
        job.seconds = time.monotonic() - started

    def _report(self, job: "Write") -> None:
        if job.failure is not None:
            raise job.failure
        if job.superseded:
            log.debug("%s: a round changed Θ before the checkpoint could write it: written again now", self.name)
            self.saved_at -= self.interval()  # due again at the next step
        elif job.error is not None:
            newest = checkpoint.list_checkpoints(self.folder)
            self.error = (
                f"could not write a checkpoint to {self.folder} ({job.error}); "
                f"{'the newest saved one, ' + newest[0].name + ', is kept' if newest else 'none was saved before'}:"
                f" free space there or give --checkpoint-dir another disk")
            log.error("%s: %s", self.name, self.error)
        else:
            self.error, self.write_seconds = None, job.seconds
            self.metrics.write(schema.Checkpoint(peer=self.name, version=job.meta["version"], path=str(job.path),
                                                 why=job.why, seconds=job.seconds, stall_seconds=job.stall_seconds))

    def note_contribution(self, diloco: DiLoCo, c, fragment: Optional[int] = None) -> None:
        """Each contribution as it leaves: should we die before the next checkpoint, the restart knows that the
        newest one's unmerged progress went out in it (`DiLoCo.unsettled`). A failed write costs that knowledge
        only: the restart then rebases the progress as before. With --fragments, one note per fragment."""
        try:
            checkpoint.note_contribution(self.folder, c, diloco.trainer.total_steps,
                                         getattr(diloco.trainer.batches, "position", None), fragment)
        except OSError as e:
            log.warning("%s: could not note the contribution in %s: %s", self.name, self.folder, e)

    def note_merged(self, settled, fragment: Optional[int] = None) -> None:
        """A round that merged the newest contribution: noted beside it (`checkpoint.note_merged`)."""
        if isinstance(settled.outcome, (Committed, Solo)):
            try:
                checkpoint.note_merged(self.folder, fragment)
            except OSError as e:
                log.warning("%s: could not note the merge in %s: %s", self.name, self.folder, e)

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
        checkpoint.remove_interrupted(self.folder)
        found = checkpoint.load_latest(self.folder, self.workload.n_params, report=log.warning)
        if found is None:
            return
        if not is_ours(self.cfg, found.meta):
            log.warning("%s: ignoring checkpoint %s: it is of run %r, model %r", self.name, found.path,
                        found.meta.get("run_id"), found.meta.get("model"))
            return
        fragments = self.cfg.swarm.fragments
        saved = found.meta.get("fragments")
        if fragments == 1 and saved is not None:
            raise ConfigError(f"{found.path} was saved with --fragments {saved.get('count')}: start with it, or "
                              "give another --checkpoint-dir")
        contributed = checkpoint.last_contribution(self.folder) if fragments == 1 else {
            i: checkpoint.last_contribution(self.folder, i) for i in range(fragments)}
        try:
            note = diloco.restore_checkpoint_state(found.meta, found.tensors, contributed)
        except checkpoint.CheckpointError as e:  # split otherwise (another --fragments): this run cannot use it
            raise ConfigError(f"{found.path}: {e}") from None
        # copied into the model, Θ and the optimizer: free the loaded tensors now rather than keep them beside
        # the model for the whole run
        found.tensors.clear()
        if note:
            log.warning("%s: %s", self.name, note)
        meta = found.meta
        log.info("%s: resumed from checkpoint %s (version %d)", self.name, found.path, meta["version"])
        self.metrics.write(schema.Restore(peer=self.name, version=meta["version"], digest=meta["digest"],
                                          path=str(found.path), inner_step=diloco.trainer.total_steps))
