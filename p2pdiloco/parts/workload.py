"""What a peer trains, without the model-sized tensors: the device, the data, the model's config and shapes,
the validation batches. Read before the helper processes fork, so they share it (read-only once loaded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from p2pdiloco.config import ConfigError, PeerConfig
from p2pdiloco.core.outer import Segment
from p2pdiloco.runtime.paging import machine_memory_bytes
from p2pdiloco.training.data import (BatchStream, TrainingData, bits_per_byte_factor, load_data, order_seed,
                                     validation_batches)
from p2pdiloco.training.inner import bitsandbytes
from p2pdiloco.core.fragments import RULE as FRAGMENT_RULE
from p2pdiloco.training.model import build_model, config_fingerprint, rda_segments, resolve_config
from p2pdiloco.training.ranks import Ranks, Strided, rank_device
from p2pdiloco.training.tokenizer import vocab_size


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


@dataclass(frozen=True)
class Workload:
    device: torch.device
    data: TrainingData
    model_config: object  # transformers' PretrainedConfig
    n_params: int
    segments: list[Segment]
    val: list
    bpb_factor: float  # validation loss → bits per byte of text: compares runs whatever their tokenizer
    shapes: tuple = ()  # each parameter's name and shape, in the flat layout's order (--fragments splits them)

    def bpb(self, loss: Optional[float]) -> Optional[float]:
        return None if loss is None else loss * self.bpb_factor

    def settings(self, cfg: PeerConfig) -> dict[str, str]:
        """What must match to merge: the model's config, the tokenizer and the data join by hash (16 hex digits);
        the RDA norms each member sends (a node that only reduces parts reads how many from here)."""
        settings = cfg.merge_settings(self.n_params, dict(
            model_config=config_fingerprint(self.model_config)[:16],
            tokenizer=self.data.tokenizer_fingerprint[:16], data=self.data.fingerprint[:16],
            norms=str(len(self.segments) if cfg.outer.rda else 0)))
        if cfg.swarm.fragments > 1:  # how the model is split, and into how many (P = 1 says nothing: as before)
            settings["fragments"] = f"{cfg.swarm.fragments}:{FRAGMENT_RULE}"
        return settings


TOKEN_CACHE = "token-cache"  # under --checkpoint-dir: text tokenized once, read back at every restart


def prepare(cfg: PeerConfig) -> Workload:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = rank_device(pick_device(cfg.device))  # under torchrun, each rank its own GPU
    if cfg.inner.optimizer == "adamw8bit":
        bitsandbytes()
    # shards read a window at a time, or text tokenized now: read-only once loaded, so forked helpers share it
    data = load_data(cfg.data, cfg.tokenizer, token_cache=cfg.checkpoint_dir / TOKEN_CACHE)
    model_config = resolve_config(cfg.model, vocab_size(data.tokenizer), cfg.inner.seq_len, cfg.init_from)
    with torch.device("meta"):  # the model's shapes, no memory
        shapes = build_model(model_config, cfg.seed)
    val = validation_batches(data.val, cfg.eval_batches, cfg.inner.batch_size, cfg.inner.seq_len)
    return Workload(device, data, model_config, sum(p.numel() for p in shapes.parameters()), rda_segments(shapes),
                    val, bits_per_byte_factor(val, data.tokenizer),
                    tuple((name, tuple(p.shape)) for name, p in shapes.named_parameters()))


def member_stream(cfg: PeerConfig, workload: Workload, seed: int, ranks: Optional[Ranks]):
    """This member's batches; with several ranks, dealt out to them (rank r's step s: batch s·N + r)."""
    stream = BatchStream(workload.data.sources, cfg.inner.batch_size, cfg.inner.seq_len, seed,
                         run_seed=order_seed(cfg.swarm.run_id))
    return stream if ranks is None else Strided(stream, ranks)


# By default the global state waits on disk where Θ and the momentum (8 bytes a parameter) would hold more than this
# share of the machine's memory: there the saving matters (a 1B model's 8 GB), and it costs no throughput measured
# (docs/hardware.md); below it a run writes nothing to disk that it does not need to
PARK_SHARE = 1 / 16


def parks_global_state(setting: Optional[bool], n_params: int, fragments: int, machine_bytes: int) -> bool:
    """`--global-state-on-disk` as set, or by default (None) where the state is large for the machine: not with
    fragments, whose rounds do not run on it yet."""
    if setting is not None:
        return setting
    return fragments == 1 and 8 * n_params > PARK_SHARE * machine_bytes


def parking_folder(cfg: PeerConfig, n_params: int) -> Optional[Path]:
    """Where Θ, the momentum and the averaging buffer wait in files (`--global-state-on-disk`; None: memory).
    The files go away with us; the run's folder, as an unnamed peer's own is not known before its DHT starts."""
    parks = parks_global_state(cfg.global_state_on_disk, n_params, cfg.swarm.fragments, machine_memory_bytes())
    return cfg.checkpoint_dir / cfg.swarm.run_id if parks else None
