"""A peer, top to bottom: build → join → train (rounds merge in the background) → leave."""

from __future__ import annotations

import faulthandler
import gc
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from p2pdiloco.training import checkpoint
from p2pdiloco.config import ConfigError, PeerConfig
from p2pdiloco.training.data import (BatchStream, bits_per_byte_factor, load_data, order_seed, stream_seed,
                                     validation_batches)
from p2pdiloco.core.consensus import consensus_distance, fork_distance, sketch
from p2pdiloco.training.diloco import DiLoCo, Settled, train
from p2pdiloco.protocol.outcomes import Contribution
from p2pdiloco.training.inner import InnerTrainer, bitsandbytes, evaluate, flat_params
from p2pdiloco.training.parked import global_vectors
from p2pdiloco.runtime.faults import FaultPlan
from p2pdiloco.runtime.heap import give_back_free_heap
from p2pdiloco.runtime.lifeline import start_lifeline
from p2pdiloco.runtime import schema
from p2pdiloco.runtime.metrics import Progress, open_sinks
from p2pdiloco.training.model import build_model, config_fingerprint, rda_segments, resolve_config
from p2pdiloco.training.tokenizer import vocab_size
from p2pdiloco.training.spill import OnDisk
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.timing import RoundClock

log = logging.getLogger("p2pdiloco")
STATE_DOWNLOAD_TIMEOUT = 60.0
WINDOW = 10  # inner steps per metrics record
# Leaving on SIGTERM/Ctrl-C has a 10 s bound in all: the round in flight, a checkpoint, the final
# evaluation and stopping the helpers must fit, also on a slow, loaded machine.
LEAVE_ROUND_WAIT = 4.0  # a round already exchanging tensors may finish (one still matchmaking is cancelled)
LEAVE_STOP_WAIT = 2.5  # the averager leaving its groups, side by side with withdrawing our record
FINISH_ROUND_WAIT = 120.0  # at max rounds/time: let the last round finish
JOIN_WAIT_ON_LEAVE = 3.0  # leaving during a warm start's background connection: how long it may finish


def mean_loss(losses: list[torch.Tensor]) -> float:
    """One host read for many steps' losses (each still on the device)."""
    return float(torch.stack(losses).float().mean()) if losses else 0.0


def _fmt_loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


@dataclass
class WarmStart:
    """The hand-over between the connecting thread and the training thread of a restarted peer."""

    forked: threading.Event = field(default_factory=threading.Event)  # the DHT and averager processes run
    restored: threading.Event = field(default_factory=threading.Event)  # θ and Θ are built and restored


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"--device {name}: torch sees no CUDA device (torch {torch.__version__}, {build}); "
                              "use --device cpu, or install a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                              f"numbered from 0")
    return device


class Peer:
    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.stop = threading.Event()
        self.dht = self.merger = self.heartbeat = self.lifeline = self.metrics = self.peer_id = None
        self._join_thread: threading.Thread | None = None  # a warm start connects while training
        self._join_done = threading.Event()
        self._warm: Optional[WarmStart] = None
        self._joined_state = None
        self.join_error: BaseException | None = None
        self.leave_error: BaseException | None = None
        self.checkpoint_error: str | None = None  # the last checkpoint write failed: why, and what to do

    # ---- lifecycle -------------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self._prepare()
            # only the metadata now: the tensors are read after the helper processes fork, which would otherwise
            # keep a copy of every page of them (and of the model) that we free or write afterwards
            meta = checkpoint.latest_meta(self.checkpoint_folder) if self.cfg.name else None
            warm = bool(meta and self._is_ours(meta) and "stream_seed" in meta and self.cfg.swarm.initial_peers)
            if warm:
                self._start_warm()
            else:
                self._join(look_for_checkpoint=True)
            summary = self._train()
            if self.join_error is not None:
                raise self.join_error  # after the work of this stay was checkpointed
            if self.leave_error is not None:
                raise self.leave_error  # after the summary: a run that could not save ends non-zero
            return summary
        finally:
            self.close()

    def _prepare(self) -> None:
        """Everything but the model-sized tensors, which come after the helper processes fork (`_materialize`)."""
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = pick_device(cfg.device)
        if cfg.inner.optimizer == "adamw8bit":
            bitsandbytes()
        # shards read a window at a time, or text tokenized now: read-only once loaded, so forked helpers share it
        self.data = load_data(cfg.data, cfg.tokenizer)
        self.model_config = resolve_config(cfg.model, vocab_size(self.data.tokenizer), cfg.inner.seq_len,
                                           cfg.init_from)
        with torch.device("meta"):  # the model's shapes, no memory
            shapes = build_model(self.model_config, cfg.seed)
        self.n_params = sum(p.numel() for p in shapes.parameters())
        self.segments = rda_segments(shapes)
        self.val = validation_batches(self.data.val, cfg.eval_batches, cfg.inner.batch_size, cfg.inner.seq_len)
        self.bpb_factor = bits_per_byte_factor(self.val, self.data.tokenizer)
        self.model = self.state = self.global_vectors = None
        self.clock = RoundClock()
        self.name = cfg.name

    def _materialize(self) -> None:
        """θ and Θ. A cold start builds them only once the DHT and averager processes have forked: a child
        forked after them keeps its own copy of every page the trainer writes afterwards (copy-on-write), which
        cost about 12 bytes per parameter across the two helpers (the 100M model, measured)."""
        if self.model is None:
            cfg = self.cfg
            self.model = build_model(self.model_config, cfg.seed, cfg.init_from).to(self.device)
            self.global_vectors = vectors = global_vectors(self.n_params, self._parking_folder())
            theta = flat_params(self.model, out=vectors.theta)  # no staging copy beside it, from a GPU either
            self.state = GlobalState(theta, cfg.outer.lr, cfg.outer.momentum, storage=(theta, vectors.momentum),
                                     page_out=vectors.page_out)
            self._park()

    def _parking_folder(self) -> Optional[Path]:
        """Where Θ, the momentum and the averaging buffer wait in files (`--global-state-on-disk`; None: memory).
        The files go away with us; the run's folder, as an unnamed peer's own is not known yet."""
        cfg = self.cfg
        return cfg.checkpoint_dir / cfg.swarm.run_id if cfg.global_state_on_disk else None

    def _park(self) -> None:
        """Θ and the momentum are cold until a round starts or ends, an evaluation, a checkpoint or a joiner
        reads them (`training.parked`; nothing to do where they are kept in memory). What the round's work freed
        goes back to the kernel too (`runtime.heap`)."""
        if self.global_vectors is not None:
            self.global_vectors.page_out()
        give_back_free_heap()

    def _join(self, look_for_checkpoint: bool) -> None:
        """Cold start: connect, resume our checkpoint if any, fetch the swarm's state, then train. The checkpoint
        is read only now, after the helper processes forked (an unnamed peer's folder is known only now too)."""
        self._connect()
        self._make_diloco(stream_seed(self.peer_id, self.cfg.swarm.run_id), self.merger)
        found = self._find_checkpoint() if look_for_checkpoint else None
        if found is not None:
            self._restore_checkpoint(found)
        if self.cfg.swarm.initial_peers:
            self._resync("joining")
        self._publish_state()

    def _start_warm(self) -> None:
        """A restarted peer trains from its checkpoint while connecting to the swarm and fetching its state
        (seconds: the DHT, the averager, the transfer); the steps taken by then are rebased onto the swarm's
        state and go into our first contribution, so they are not lost. Only the helper processes' start comes
        first (the DHT's bootstrap: a second or two): the model is built after they forked, as in a cold start."""
        self._warm = WarmStart()
        # a daemon: leaving must not wait for a connection still under way (the lifeline takes its helpers down)
        self._join_thread = threading.Thread(target=self._connect_in_background, name="join", daemon=True)
        self._join_thread.start()
        while not (self._warm.forked.wait(0.1) or self._join_done.is_set()):
            pass  # a connection that failed first is reported at the first step, after which we save and leave
        try:
            self._materialize()
            self._make_diloco(0, merger=None)  # the checkpoint restores the stream's seed and position
            found = self._find_checkpoint()
            if found is not None:  # (gone or damaged since we looked: we go on from the swarm's state)
                self._restore_checkpoint(found)
        finally:
            self._warm.restored.set()

    def _connect_in_background(self) -> None:
        try:
            self._connect()
            if not self.stop.is_set() and self._swarm_is_ahead():
                self._joined_state = self.merger.download(self.state.version + 1, "joining",
                                                          timeout=STATE_DOWNLOAD_TIMEOUT)
        except BaseException as e:  # reported by the training thread, which leaves in order
            self.join_error = e
        finally:
            self._join_done.set()

    def _finish_warm_join(self) -> None:
        """Training thread, between inner steps (no round in flight yet: we could not contribute)."""
        self._join_thread = None
        if self.join_error is not None:
            log.error("%s: could not join the swarm: %s; saving and leaving", self.name, self.join_error)
            self.stop.set()
            return
        self.diloco.merger, self.diloco.peer = self.merger, self.peer_id
        self.metrics.write(schema.Joined(peer=self.name, peer_id=self.peer_id, inner_step=self.diloco.trainer.total_steps,
                                         unmerged_steps=self.diloco.unmerged_steps,
                                         seconds=time.monotonic() - self.started))
        loaded, self._joined_state = self._joined_state, None
        if loaded is not None:
            self._adopt(loaded, "joining")
        else:  # nobody ahead of us, or no state came: a fork at our version is settled at our first round
            log.info("%s: going on from version %d", self.name, self.state.version)
        self._publish_state()

    def _connect(self) -> None:
        from p2pdiloco.swarm import node
        from p2pdiloco.swarm.records import Heartbeat, PeerRecord
        from p2pdiloco.swarm.rounds import SwarmMerger

        cfg = self.cfg
        # before the DHT: whatever it spawns is taken down with us, even if we die (or leave) while it starts
        self.lifeline = start_lifeline()
        # the helpers fork from us next: objects made so far (the imports: transformers alone brings 1,713
        # modules) leave the collector's generations, or each child's collections would touch, and so copy,
        # every page that holds one (the tiny peer's peak: 1.14 GB against 1.25, one run each)
        gc.collect()
        gc.freeze()
        self.dht = node.start_dht(cfg.swarm)
        self.peer_id = node.peer_id(self.dht)
        self.name = self.name or self.peer_id[-6:]
        self._open_metrics()
        addresses = cfg.log_dir / f"{self.name}.addrs"
        node.write_addresses(self.dht, addresses)
        if not cfg.swarm.initial_peers:
            log.info("started a new swarm; others join with:\n  %s\n(addresses written to %s)",
                     "\n  ".join(f"p2pdiloco join --initial-peers {a}" for a in node.visible_addresses(self.dht)),
                     addresses)
        overlap = cfg.swarm.overlap_steps or cfg.inner.steps  # the next contribution is due H steps later
        self.merger = SwarmMerger(self.dht, cfg.swarm, cfg.outer, self.n_params, self.segments, None,
                                  self._share_state, self.stop, self.clock, overlap,
                                  FaultPlan.parse(cfg.swarm.fault_plan), buffer_folder=self._parking_folder())
        self.merger.why_not_adopt = self._why_not_adopt
        self._helpers_forked()
        self.heartbeat = self.merger.heartbeat = Heartbeat(
            self.dht, cfg.swarm.run_id, PeerRecord(peer=self.peer_id, name=self.name, version=self.state.version,
                                                   digest=self.state.digest, client_mode=cfg.swarm.client_mode,
                                                   settings=self._settings()))
        if cfg.swarm.initial_peers:
            self._refuse_a_mismatch()

    def _helpers_forked(self) -> None:
        """Both helper processes run: now the model-sized tensors. A warm start builds and restores them in
        the training thread; our record (version, digest) waits for that."""
        if self._warm is None:
            self._materialize()
            return
        self._warm.forked.set()
        while not self._warm.restored.wait(0.1):
            if self.stop.is_set():
                raise RuntimeError("left while restoring the checkpoint")

    def _share_state(self):
        """A peer asking for our state (hivemind's averager advertises it from its start) in the moment before
        we built it is told so, and asks another donor."""
        if self.state is None:
            raise RuntimeError("this peer is still starting: no state to share yet")
        try:
            return self.state.snapshot(shared=True)
        finally:
            self._park()

    def _why_not_adopt(self, metadata: dict, tensors: list, corroborated: bool):
        """A downloaded state further from ours than its versions explain is refused (p2pdiloco.core.reach)."""
        return None if self.state is None else self.state.why_not_adopt(metadata, tensors, corroborated)

    def _settings(self) -> dict[str, str]:
        """The model's config, the tokenizer and the data join the settings by hash (16 hex digits each)."""
        return self.cfg.merge_settings(self.n_params, dict(
            model_config=config_fingerprint(self.model_config)[:16],
            tokenizer=self.data.tokenizer_fingerprint[:16], data=self.data.fingerprint[:16]))

    def _refuse_a_mismatch(self) -> None:
        """At join: a setting that cannot merge with the live peers' ends this peer now, saying which."""
        from p2pdiloco.protocol.compat import mismatch, wire_mismatch
        from p2pdiloco.swarm.node import SwarmConnectError

        live = self.merger.live_others()
        why = wire_mismatch(self.merger.other_wires(), len(live)) or mismatch(self._settings(), live)
        if why is not None:
            raise SwarmConnectError(f"cannot merge with this swarm: {why}")

    def _make_diloco(self, seed: int, merger) -> None:
        cfg = self.cfg
        stream = BatchStream(self.data.sources, cfg.inner.batch_size, cfg.inner.seq_len, seed,
                             run_seed=order_seed(cfg.swarm.run_id))
        trainer = InnerTrainer(self.model, stream, cfg.inner, self.device, cfg.throttle)
        # our last merged Δ waits on disk beside our checkpoints: only a lost fork reads it (4 B/param less)
        self.diloco = DiLoCo(trainer, self.state, merger, self.peer_id, self.name, self.clock,
                             eager=cfg.outer.application == "eager",
                             keep=OnDisk(self.checkpoint_folder / "fork-recovery"))
        self._open_metrics()

    def _open_metrics(self) -> None:
        """Once our name is known (a warm start knows it before connecting, a cold one only after)."""
        if self.metrics is None:
            cfg = self.cfg
            self.metrics = open_sinks(cfg.metrics_sinks, cfg.log_dir, self.name, cfg.swarm.run_id,
                                      config=dict(model=cfg.model, inner_steps=cfg.inner.steps,
                                                  compression=cfg.swarm.compression, mode=cfg.swarm.mode))

    def _resync(self, why: str) -> bool:
        """Download the newest global state from live peers (validated: never trust the network)."""
        if not self._swarm_is_ahead():
            log.info("%s: no live peer is ahead of version %d: starting from it", self.name, self.state.version)
            return False
        loaded = self.merger.download(self.state.version + 1, why, timeout=STATE_DOWNLOAD_TIMEOUT)
        if loaded is None:
            log.warning("%s: could not download the swarm's state (%s); going on from version %d", self.name,
                        why, self.state.version)
            return False
        self._adopt(loaded, why)
        return True

    def _swarm_is_ahead(self) -> bool:
        """Only a newer version is worth fetching: a peer restored ahead of the others (they restarted from
        older checkpoints) would otherwise wait out the download deadline for a state nobody has, and one
        at our version with another digest (a fork) is settled by the first round's catch-up rule."""
        return any(r.version > self.state.version for r in self.merger.live_others())

    def _adopt(self, loaded, why: str) -> None:
        self.diloco.adopt(*loaded)
        log.info("%s: resynced (%s) to version %d", self.name, why, self.state.version)
        self.metrics.write(schema.Resync(peer=self.name, why=why, version=self.state.version,
                                         digest=self.state.digest))
        self._park()

    # ---- checkpoints -----------------------------------------------------------------------------------
    @property
    def checkpoint_folder(self) -> Path:
        return self.cfg.checkpoint_dir / self.cfg.swarm.run_id / self.name

    def _save_checkpoint(self, why: str) -> None:
        if self.diloco.in_flight is not None:
            return  # only between rounds (see DiLoCo.checkpoint_state)
        meta, tensors = self.diloco.checkpoint_state()
        meta.update(model=self.cfg.model, n_params=self.n_params, run_id=self.cfg.swarm.run_id, why=why,
                    model_config=self.model_config.to_dict(), tokenizer_sha256=self.data.tokenizer_fingerprint,
                    data_sha256=self.data.fingerprint)
        self._keep_tokenizer()
        try:
            path = checkpoint.save(self.checkpoint_folder, meta, tensors, keep=self.cfg.keep_checkpoints)
        except checkpoint.CheckpointWriteError as e:  # the write is undone, the checkpoints already saved stay
            newest = checkpoint.list_checkpoints(self.checkpoint_folder)
            self.checkpoint_error = (
                f"could not write a checkpoint to {self.checkpoint_folder} ({e}); "
                f"{'the newest saved one, ' + newest[0].name + ', is kept' if newest else 'none was saved before'}:"
                f" free space there or give --checkpoint-dir another disk")
            log.error("%s: %s", self.name, self.checkpoint_error)
            return
        self.checkpoint_error = None
        self.metrics.write(schema.Checkpoint(peer=self.name, version=meta["version"], path=str(path), why=why))

    def _keep_tokenizer(self) -> None:
        """The tokenizer beside our checkpoints, once: `p2pdiloco export` and `sample` read it from there."""
        folder = self.checkpoint_folder / checkpoint.TOKENIZER_DIR
        if not (folder / "tokenizer.json").is_file():
            try:
                self.data.tokenizer.save_pretrained(str(folder))
            except OSError as e:
                log.warning("%s: could not keep the tokenizer in %s: %s", self.name, folder, e)

    def _find_checkpoint(self):
        found = checkpoint.load_latest(self.checkpoint_folder, self.n_params, report=log.warning)
        if found is None:
            return None
        if not self._is_ours(found.meta):
            log.warning("%s: ignoring checkpoint %s: it is of run %r, model %r", self.name, found.path,
                        found.meta.get("run_id"), found.meta.get("model"))
            return None
        return found

    def _is_ours(self, meta: dict) -> bool:
        return meta.get("run_id") == self.cfg.swarm.run_id and meta.get("model") == self.cfg.model

    def _restore_checkpoint(self, found) -> None:
        note = self.diloco.restore_checkpoint_state(found.meta, found.tensors)
        # copied into the model, Θ and the optimizer: free the loaded tensors now, before a warm start's helpers
        # fork (they would keep a copy) and rather than beside the model for the whole run
        found.tensors.clear()
        if note:
            log.warning("%s: %s", self.name, note)
        log.info("%s: resumed from checkpoint %s (version %d)", self.name, found.path, self.state.version)
        self.metrics.write(schema.Restore(peer=self.name, version=self.state.version, digest=self.state.digest,
                                          path=str(found.path), inner_step=self.diloco.trainer.total_steps))
        self._park()

    def _publish_state(self) -> None:
        self.own_sketch = sketch(self.state.params, done=self.state.page_out)
        self.merger.publish_state(self.state.version, self.state.digest, self.own_sketch)

    def _evaluate_global(self) -> float:
        """Validation loss of Θ, the global model every peer converges to (θ, the local one, runs ahead)."""
        return evaluate(self.model, self.val, self.device, params=self.state.params,  # no second model
                        done=self.state.page_out)

    def _bpb(self, loss):
        """Validation in bits per byte of text: compares runs whatever their tokenizer."""
        return None if loss is None else loss * self.bpb_factor

    # ---- training ---------------------------------------------------------------------------------------
    def _train(self) -> dict:
        cfg = self.cfg
        self.started = time.monotonic()
        # with evaluations off (chaos runs, benchmarks) a (re)starting peer goes straight to training
        initial_val = self._evaluate_global() if cfg.eval_every else None
        self._park()
        self.metrics.write(schema.Start(peer=self.name, peer_id=self.peer_id, n_params=self.n_params,
                                        val_loss=initial_val, val_bpb=self._bpb(initial_val),
                                        version=self.state.version, corpus=self.data.description,
                                        mode=cfg.swarm.mode))
        self.progress = Progress(self.name, cfg.inner.steps)
        self.progress.start_round(0, self.state.version)
        self.rounds = self.merged_rounds = 0
        self.last_island = 1
        self.compute_seconds = 0.0
        self.bytes_sent = 0  # by our averager, over every round of this process
        self.training_ended = None
        self.round_losses: list[torch.Tensor] = []
        self.window = dict(start=time.monotonic(), losses=[], seconds=0.0)
        self.window_loss = float("nan")
        train(self.diloco, cfg.inner.steps, self._should_leave, self._on_step, self._on_round,
              synchronous=cfg.swarm.mode == "sync", round_seconds=cfg.inner.round_seconds,
              final_wait=self._round_wait_on_leaving,
              on_contribute=self._on_contribute)
        if cfg.checkpoint_every:
            self._save_checkpoint("leaving")
            if self.checkpoint_error:  # said once more, on exit: what this stay trained was not saved
                self.leave_error = checkpoint.CheckpointWriteError(self.checkpoint_error)
        final_val = self._evaluate_global()
        wall = time.monotonic() - self.started
        # utilization while training: leaving (the last round's wait, checkpoint, final evaluation) is not
        # part of it; `seconds` is the whole stay
        training = (self.training_ended or time.monotonic()) - self.started
        summary = schema.Summary(peer=self.name, rounds=self.rounds, merged_rounds=self.merged_rounds,
                                 version=self.state.version, initial_val=initial_val, final_val=final_val,
                                 final_val_bpb=self._bpb(final_val),
                                 digest=self.state.digest, seconds=wall, training_seconds=training,
                                 compute_seconds=self.compute_seconds,
                                 utilization=self.compute_seconds / max(training, 1e-9), tokens=self._tokens_trained,
                                 device_peak_bytes=(torch.cuda.max_memory_allocated(self.device)
                                                    if self.device.type == "cuda" else None))
        self.metrics.write(summary)
        log.info("%s: done after %d rounds (version %d): val loss %s -> %.4f (%.4f bits per byte), compute "
                 "%.0f%% of wall time", self.name, self.rounds, self.state.version, _fmt_loss(initial_val),
                 final_val, self._bpb(final_val), 100 * summary.utilization)
        return summary.to_dict()

    @property
    def _tokens_trained(self) -> int:
        return self.diloco.trainer.total_steps * self.diloco.trainer.tokens_per_step

    def _round_wait_on_leaving(self) -> float:
        """How long the round in flight may still take once training ends. At max rounds/time it may finish.
        Leaving on a signal, a round still looking for an island is cancelled now (its outcome, a rollback,
        comes back at once) and one already exchanging tensors gets LEAVE_ROUND_WAIT."""
        if not self.stop.is_set():
            return FINISH_ROUND_WAIT
        if self.merger is not None and self.merger.leave_round():
            log.info("%s: leaving: the round still looking for an island is cancelled", self.name)
        return LEAVE_ROUND_WAIT

    def _should_leave(self) -> bool:
        cfg = self.cfg
        leave = (self.stop.is_set() or (cfg.max_rounds is not None and self.rounds >= cfg.max_rounds)
                 or (cfg.max_time is not None and time.monotonic() - self.started >= cfg.max_time))
        if leave and self.training_ended is None:
            self.training_ended = time.monotonic()
        return leave

    def _on_step(self, loss: torch.Tensor, seconds: float) -> None:
        """`loss` stays on the device: on a GPU it is read once per window of steps, never once per step."""
        if self._join_thread is not None and self._join_done.is_set():
            self._finish_warm_join()
        w = self.window
        self.compute_seconds += seconds
        w["losses"].append(loss)
        w["seconds"] += seconds
        self.round_losses.append(loss)
        rate = len(w["losses"]) * self.diloco.trainer.tokens_per_step / max(time.monotonic() - w["start"], 1e-9)
        shown = self.window_loss if self.diloco.trainer.on_gpu else float(loss)
        self.progress.step(shown, rate, island=self.last_island)
        if len(w["losses"]) == WINDOW:
            self.window_loss = mean_loss(w["losses"])
            self.metrics.write(schema.Window(peer=self.name, step=self.diloco.trainer.total_steps,
                                             tokens=self._tokens_trained, loss=self.window_loss,
                                             tokens_per_s=rate, step_seconds=w["seconds"] / WINDOW,
                                             in_flight=self.diloco.in_flight is not None, **self._goodput_fields()))
            if self.heartbeat is not None:
                self.heartbeat.note(inner_step=self.diloco.trainer.total_steps, tokens_per_s=rate,
                                    loss=self.window_loss)
            w.update(start=time.monotonic(), losses=[], seconds=0.0)

    def _goodput_fields(self) -> dict:
        """Cumulative over this process's life: inner-step time, and the part of it that reached Θ."""
        return dict(compute_seconds=self.compute_seconds, merged_seconds=self.diloco.merged_seconds)

    def _on_contribute(self, c: Contribution) -> None:
        self.metrics.write(schema.Contribute(peer=self.name, version=c.version, tokens=c.tokens, steps=c.steps))
        self._park()

    def _on_round(self, settled: Settled | None) -> None:
        if settled is None:
            return
        o = settled.outcome
        self.rounds += 1
        self.merged_rounds += int(settled.applied)
        self.last_island = max(1, len(o.members))
        self._lie_if_planned()
        self._publish_state()
        if settled.applied and self.cfg.checkpoint_every and self.merged_rounds % self.cfg.checkpoint_every == 0:
            self._save_checkpoint("periodic")
        evaluate_now = settled.applied and self.cfg.eval_every and self.merged_rounds % self.cfg.eval_every == 0
        val = self._evaluate_global() if evaluate_now else None
        self._record_round(settled, val)
        self.progress.start_round(self.rounds, self.state.version)
        self._park()

    def _lie_if_planned(self) -> None:
        """A test's lying peer only (runtime.faults, `hostile_ahead`): a state of its own, versions ahead."""
        if self.merger is not None:
            from p2pdiloco.swarm.rounds import hostile_state
            hostile_state(self.merger.fault_plan, self.state)

    def _record_round(self, settled: Settled, val) -> None:
        o, c = settled.outcome, settled.contribution
        # the others as of the last heartbeat (never a DHT call on the training thread), and us as we are now
        others = [r for r in self.heartbeat.records() if r.peer != self.peer_id]
        own = (self.state.version, self.state.digest, self.own_sketch)
        others_states = [(r.version, r.digest, r.sketch) for r in others if r.sketch]
        states = [*others_states, own]
        versions = [r.version for r in others] + [self.state.version]
        distance = consensus_distance(states)
        wall = time.monotonic() - self.started
        self.metrics.write(schema.Round(
            peer=self.name, round=self.rounds, version=self.state.version, applied=settled.applied,
            reason=o.reason, loss=mean_loss(self.round_losses), val_loss=val, val_bpb=self._bpb(val),
            swarm_tokens=self.state.tokens, lr=self.diloco.trainer.optimizer.param_groups[0]["lr"],
            tokens=c.tokens, tokens_trained=self._tokens_trained, from_version=c.version,
            unmerged_tokens=settled.unmerged_tokens, steps_in_flight=settled.steps_in_flight,
            outcome=o.kind, members=[m.name or m.peer for m in o.members],
            member_tokens=[m.tokens for m in o.members], member_versions=[m.version for m in o.members],
            member_steps=[m.steps for m in o.members],
            member_norms=[m.delta_norm for m in o.members], excluded=o.excluded, bounded=o.bounded,
            weights=o.weights, tokens_merged=sum(m.tokens for m in o.members),
            group_id=o.group_id, round_seconds=o.seconds, quorum_seconds=o.quorum_seconds,
            sync_seconds=o.sync_seconds, sync_ended=o.sync_ended or None, codec_cpu_seconds=o.codec_cpu_seconds,
            deadline_seconds=o.deadline_seconds, grace_seconds=o.grace_seconds,
            step_seconds_ema=self.diloco.clock.step.get(), bytes_sent=o.bytes_sent, bytes_received=o.bytes_received,
            allreduce_bytes_model=o.allreduce_bytes_model,
            adopted=o.adopted, waited_for_island=o.waited_for_island, consensus_distance=distance,
            fork_distance=fork_distance(own, others_states),
            version_spread=max(versions) - min(versions), live_peers=len(versions), recovered_tokens=self.diloco.recovered_tokens,
            **self._goodput_fields(), utilization=self.compute_seconds / max(wall, 1e-9), wall=wall,
            digest=self.state.digest))
        val_text = f" val {val:.4f}" if val is not None else ""
        self.progress.end_round(f"round {self.rounds}: {'merged' if settled.applied else 'not merged'} "
                                f"({o.reason}, island {len(o.members)}) v{self.state.version}{val_text} "
                                f"in {o.seconds:.1f}s, {settled.steps_in_flight} steps in flight, "
                                f"consensus distance {distance:.3g}")
        self.round_losses = []
        self.bytes_sent += o.bytes_sent or 0
        self.heartbeat.note(rounds=self.rounds, island=len(o.members), bytes_sent=self.bytes_sent)

    # ---- leaving ----------------------------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: leave at once
        log.info("stopping after the current step (Ctrl-C again to leave at once)")
        self.stop.set()

    def close(self) -> None:
        from p2pdiloco.swarm import node

        if self._join_thread is not None:  # left while connecting: let the connection finish, then undo it
            self._join_thread.join(JOIN_WAIT_ON_LEAVE)
            if self._join_thread.is_alive():
                log.warning("%s: still connecting; leaving it to the lifeline", self.name)
        if getattr(self, "diloco", None) is not None:
            self.diloco.close()
        # withdrawing our record (others stop waiting for us) and the averager leaving its groups, side by side;
        # then the DHT, which both use. The lifeline is left running: once this process exits, it kills any
        # helper that did not stop in time.
        self._stop_side_by_side(LEAVE_STOP_WAIT, heartbeat=self.heartbeat and self.heartbeat.stop,
                                averager=self.merger and self.merger.shutdown)
        self._stop_side_by_side(node.STOP_WAIT + 0.5, dht=self.dht and (lambda: node.shutdown(self.dht)))
        self.dht = None
        if self.metrics is not None:
            self.metrics.close()

    def _stop_side_by_side(self, budget: float, **stops) -> None:
        """Run each stop in its own daemon thread and wait for them at most `budget` seconds in all."""
        started = time.monotonic()
        threads = {what: threading.Thread(target=stop, name=f"stop-{what}", daemon=True)
                   for what, stop in stops.items() if stop}
        for thread in threads.values():
            thread.start()
        for what, thread in threads.items():
            thread.join(max(0.0, started + budget - time.monotonic()))
            if thread.is_alive():
                log.warning("%s: the %s did not stop within %.1f s; leaving it to the lifeline", self.name, what,
                            budget)
        if threads and time.monotonic() - started > 1.0:  # say what ate into the leave's bound
            log.info("%s: stopping the %s took %.1f s", self.name, " and ".join(threads), time.monotonic() - started)


def run_peer(cfg: PeerConfig) -> dict:
    peer = Peer(cfg)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, peer.request_stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr
    try:
        return peer.run()
    finally:
        # the peer has left (saved, reported): a SIGTERM that comes while the interpreter exits, from a launcher
        # stopping what it still sees running, would find the default action restored and kill a clean exit (seen
        # in CI: exit -15 after "done after 9 rounds"); an ignored signal stays ignored through the exit
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
