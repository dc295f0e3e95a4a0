"""A peer, top to bottom: build → join → (train H steps → merge → outer step → evaluate)* → leave."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import torch

from p2pdiloco.config import PeerConfig, model_config
from p2pdiloco.data import BatchStream, load_corpus, stream_seed, validation_batches
from p2pdiloco.diloco import DiLoCo, GlobalState, validate_state
from p2pdiloco.inner import InnerTrainer, evaluate, flat_params
from p2pdiloco.lifeline import start_lifeline
from p2pdiloco.metrics import JsonlSink, Progress
from p2pdiloco.model import build_model

log = logging.getLogger("p2pdiloco")
STATE_DOWNLOAD_TIMEOUT = 60.0
WINDOW = 10  # inner steps per metrics record


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Peer:
    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.stop = threading.Event()
        self.dht = self.merger = self.heartbeat = self.lifeline = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self._build()
            self._join()
            return self._train()
        finally:
            self.close()

    def _build(self) -> None:
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = pick_device(cfg.device)
        self.corpus = load_corpus(cfg.data)
        self.model = build_model(model_config(cfg.model), cfg.seed).to(self.device)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.val = validation_batches(self.corpus.val, cfg.eval_batches, cfg.inner.batch_size, cfg.inner.seq_len)
        self.state = GlobalState(flat_params(self.model), cfg.outer.lr, cfg.outer.momentum)

    def _join(self) -> None:
        from p2pdiloco.swarm import node
        from p2pdiloco.swarm.records import Heartbeat, PeerRecord
        from p2pdiloco.swarm.rounds import SwarmMerger

        cfg = self.cfg
        self.dht = node.start_dht(cfg.swarm)
        self.lifeline = start_lifeline()  # after the DHT: its processes are now ours to take down with us
        self.peer_id = node.peer_id(self.dht)
        self.name = cfg.name or self.peer_id[-6:]
        addresses = cfg.log_dir / f"{self.name}.addrs"
        node.write_addresses(self.dht, addresses)
        if not cfg.swarm.initial_peers:
            log.info("started a new swarm; others join with:\n  %s\n(addresses written to %s)",
                     "\n  ".join(f"p2pdiloco join --initial-peers {a}" for a in node.visible_addresses(self.dht)),
                     addresses)
        self.heartbeat = Heartbeat(self.dht, cfg.swarm.run_id,
                                   PeerRecord(peer=self.peer_id, name=self.name, version=0, digest=self.state.digest))
        self.merger = SwarmMerger(self.dht, cfg.swarm, self.n_params, self.heartbeat, self.state.snapshot, self.stop)
        stream = BatchStream(self.corpus.train, cfg.inner.batch_size, cfg.inner.seq_len,
                             stream_seed(self.peer_id, cfg.swarm.run_id))
        trainer = InnerTrainer(self.model, stream, cfg.inner, self.device, cfg.throttle)
        self.diloco = DiLoCo(trainer, self.state, self.merger, self.peer_id, self.name)
        self.metrics = JsonlSink(cfg.log_dir / f"{self.name}.jsonl")
        if cfg.swarm.initial_peers:
            self._resync("joining")

    def _resync(self, why: str) -> bool:
        """Download the newest global state from a live peer; never serve state while we are behind."""
        self.merger.set_sharing(False, self.state.version)
        try:
            loaded = self.merger.load_state(timeout=STATE_DOWNLOAD_TIMEOUT)
            problem = "no peer shared its state" if loaded is None else validate_state(
                *loaded, self.n_params, self.state.version)
            if problem:
                log.info("%s: resync (%s) skipped: %s", self.name, why, problem)
                return False
            self.diloco.adopt(*loaded)
            log.info("%s: resynced (%s) to version %d", self.name, why, self.state.version)
            self.metrics.write("resync", peer=self.name, why=why, version=self.state.version,
                               digest=self.state.digest)
            return True
        finally:
            self.merger.set_sharing(True, self.state.version)
            self.heartbeat.update(version=self.state.version, digest=self.state.digest, ready=-1)

    # ---- training ---------------------------------------------------------------------------------------
    def _train(self) -> dict:
        cfg = self.cfg
        started = time.monotonic()
        initial_val = evaluate(self.model, self.val, self.device)
        self.metrics.write("start", peer=self.name, peer_id=self.peer_id, n_params=self.n_params,
                           val_loss=initial_val, version=self.state.version, corpus=self.corpus.description)
        progress = Progress(self.name, cfg.inner.steps)
        round_index = 0
        while not self._should_leave(round_index, started):
            progress.start_round(round_index, self.state.version)
            result = self.diloco.run_round(cfg.inner.steps, on_step=self._on_step(progress),
                                           should_stop=self.stop.is_set)
            if result.outcome.behind or (result.outcome.committed and not result.applied):
                self._resync("behind" if result.outcome.behind else "stale contribution")
            self.heartbeat.update(version=self.state.version, digest=self.state.digest, ready=-1)
            val = evaluate(self.model, self.val, self.device) if result.applied else None
            self._record_round(round_index, result, val, progress)
            round_index += 1
        final_val = evaluate(self.model, self.val, self.device)
        summary = dict(peer=self.name, rounds=round_index, version=self.state.version, initial_val=initial_val,
                       final_val=final_val, digest=self.state.digest, seconds=time.monotonic() - started)
        self.metrics.write("summary", **summary)
        log.info("%s: done after %d rounds (version %d): val loss %.4f -> %.4f", self.name, round_index,
                 self.state.version, initial_val, final_val)
        return summary

    def _should_leave(self, round_index: int, started: float) -> bool:
        cfg = self.cfg
        return (self.stop.is_set() or (cfg.max_rounds is not None and round_index >= cfg.max_rounds)
                or (cfg.max_time is not None and time.monotonic() - started >= cfg.max_time))

    def _on_step(self, progress: Progress):
        window = dict(start=time.monotonic(), losses=[])
        tokens_per_step = self.cfg.inner.batch_size * self.cfg.inner.seq_len

        def on_step(i: int, loss: float) -> None:
            window["losses"].append(loss)
            rate = len(window["losses"]) * tokens_per_step / max(time.monotonic() - window["start"], 1e-9)
            progress.step(loss, rate, island=1)
            if len(window["losses"]) == WINDOW:
                self.metrics.write("window", peer=self.name, step=self.diloco.trainer.total_steps,
                                   loss=sum(window["losses"]) / WINDOW, tokens_per_s=rate)
                self.heartbeat.record.inner_step = self.diloco.trainer.total_steps
                self.heartbeat.record.tokens_per_s = rate
                window.update(start=time.monotonic(), losses=[])

        return on_step

    def _record_round(self, round_index: int, result, val, progress: Progress) -> None:
        o = result.outcome
        self.metrics.write(
            "round", peer=self.name, round=round_index, version=self.state.version, applied=result.applied,
            reason=o.reason, loss=result.report.mean_loss, val_loss=val, tokens=result.report.tokens,
            pending_tokens=result.pending_tokens, members=[m.get("name", m["peer"]) for m in o.members],
            member_tokens=[m["tokens"] for m in o.members], group_id=o.group_id, round_seconds=o.seconds,
            compute_seconds=result.report.compute_seconds, bytes_sent=o.bytes_estimate,
            bytes_received=o.bytes_estimate, digest=self.state.digest)
        val_text = f" val {val:.4f}" if val is not None else ""
        progress.end_round(f"round {round_index}: {'merged' if result.applied else 'not merged'} "
                           f"({o.reason}, island {len(o.members)}) v{self.state.version} loss "
                           f"{result.report.mean_loss:.4f}{val_text} in {o.seconds:.1f}s")

    # ---- leaving ----------------------------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: leave at once
        log.info("stopping after the current step (Ctrl-C again to leave at once)")
        self.stop.set()

    def close(self) -> None:
        from p2pdiloco.swarm import node

        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.merger is not None:
            self.merger.shutdown()
        node_dht, self.dht = self.dht, None
        node.shutdown(node_dht)
        if self.lifeline is not None:
            self.lifeline.terminate()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()


def run_peer(cfg: PeerConfig) -> dict:
    peer = Peer(cfg)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, peer.request_stop)
    return peer.run()


def configure_logging(log_file: Path | None = None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # hivemind configures the root logger too: avoid printing every line twice
