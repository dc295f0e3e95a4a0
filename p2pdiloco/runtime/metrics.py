"""Metrics sinks (JSONL) and the per-peer progress display."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("p2pdiloco")


class JsonlSink:
    """Appends one JSON object per line; flushed per record so a killed peer loses nothing written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)

    def write(self, kind: str, **fields: Any) -> None:
        self._file.write(json.dumps({"kind": kind, "time": round(time.time(), 3), **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


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
