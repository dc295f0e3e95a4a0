"""Metrics sinks behind one interface (JSONL always; TensorBoard and W&B when chosen) and the progress display."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional, Protocol

from p2pdiloco.config import METRICS_SINKS
from p2pdiloco.runtime.schema import Record

log = logging.getLogger("p2pdiloco")


class MetricsSink(Protocol):
    def write(self, record: Record) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line; flushed per record so a killed peer loses nothing written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)

    def write(self, record: Record) -> None:
        self._file.write(record.to_json() + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Every numeric field as a scalar `KIND/FIELD`, at the record's step (its round, or inner step) and time.
    Files go to LOG_DIR/tensorboard/NAME: `tensorboard --logdir LOG_DIR/tensorboard` shows every peer."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.folder = folder
        self._writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: Record) -> None:
        step = record.sink_step
        if step is None:
            return  # events without a step (start, checkpoint, ...) stay in the JSONL
        for name, value in record.numbers().items():
            self._writer.add_scalar(f"{record.KIND}/{name}", value, global_step=step, walltime=record.time)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run per peer, grouped by the swarm's run id. Offline (WANDB_MODE=offline) it writes its run to
    LOG_DIR/wandb and needs no network; `wandb sync` uploads it later."""

    def __init__(self, folder: Path, name: str, group: str, config: dict):
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project="p2pdiloco", name=name, group=group, dir=str(folder), config=config)

    def write(self, record: Record) -> None:
        if record.sink_step is not None:
            self._run.log({f"{record.KIND}/{k}": v for k, v in record.numbers().items()})

    def close(self) -> None:
        self._run.finish()


class FanOut:
    """Writes every record to each sink; a failing optional sink is dropped with a warning, never the peer."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def write(self, record: Record) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as e:  # noqa: BLE001 — metrics must never stop training
                if isinstance(sink, JsonlSink):
                    raise
                log.warning("metrics sink %s failed (%s); dropping it", type(sink).__name__, e)
                self.sinks.remove(sink)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                log.warning("metrics sink %s did not close cleanly: %s", type(sink).__name__, e)


def open_sinks(chosen: tuple[str, ...], log_dir: Path, name: str, run_id: str, config: dict) -> FanOut:
    """JSONL at LOG_DIR/NAME.jsonl always, plus each chosen optional sink that is installed. One that is not
    installed (or fails to start) is skipped with a message saying why and how to get it."""
    sinks: list = [JsonlSink(log_dir / f"{name}.jsonl")]
    for choice in chosen:
        try:
            sinks.append(_open_optional(choice, log_dir, name, run_id, config))
        except ImportError as e:
            log.warning("metrics sink %r skipped: %s is not installed (pip install 'p2pdiloco[%s]')", choice,
                        e.name or choice, choice)
        except Exception as e:  # noqa: BLE001 — a sink that cannot start must not stop the peer
            hint = " (WANDB_MODE=offline keeps the run on disk, for `wandb sync` later)" if choice == "wandb" else ""
            log.warning("metrics sink %r skipped: it failed to start: %s%s", choice, e, hint)
    return FanOut(sinks)


def _open_optional(choice: str, log_dir: Path, name: str, run_id: str, config: dict):
    if choice == "tensorboard":
        return TensorBoardSink(log_dir / "tensorboard" / name)
    if choice == "wandb":
        return WandbSink(log_dir, name, run_id, config)
    raise ValueError(f"unknown metrics sink {choice!r} (choose from {', '.join(METRICS_SINKS)})")


def read_jsonl(path: Path) -> list[dict]:
    return parse_jsonl(Path(path).read_text().splitlines())


def parse_jsonl(lines) -> list[dict]:
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return records


class Progress:
    """A live bar per round when stderr is a terminal, plain log lines otherwise."""

    def __init__(self, name: str, inner_steps: int, interactive: Optional[bool] = None):
        self.name, self.inner_steps = name, inner_steps
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar = None

    def start_round(self, round_index: int, version: int) -> None:
        if self.interactive:
            from tqdm import tqdm

            self._bar = tqdm(total=self.inner_steps, desc=f"{self.name} r{round_index} v{version}",
                             leave=False, dynamic_ncols=True)

    def step(self, loss: float, tokens_per_s: float, island: int) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}", island=island, refresh=False)

    def end_round(self, message: str) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        log.info("%s %s", self.name, message)
