"""Logging set-up for a peer or bootstrap process: one handler per destination, never a line printed twice."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("p2pdiloco")


def _is_stderr(path: Path) -> bool:
    try:
        a, b = os.fstat(sys.stderr.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def configure_logging(log_file: Path | None = None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None and not _is_stderr(log_file):  # a launcher may already send stderr there
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # hivemind configures the root logger too: avoid printing every line twice
