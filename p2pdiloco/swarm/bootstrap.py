"""A DHT-only node: a stable meeting point that trains nothing; with `reduce`, also a reducer node for the
swarm's islands (p2pdiloco.swarm.reducer), for peers that nobody can dial."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from p2pdiloco.config import SwarmConfig
from p2pdiloco.runtime.lifeline import start_lifeline
from p2pdiloco.runtime.signals import on_stop_signals

log = logging.getLogger("p2pdiloco")


def run_bootstrap(cfg: SwarmConfig, log_dir: Path, name: str, reduce: bool = False) -> None:
    from p2pdiloco.swarm import node

    from p2pdiloco.runtime.logs import configure_logging

    configure_logging()
    if cfg.client_mode:
        raise node.SwarmConnectError("a bootstrap node must accept connections: drop --client-mode")
    stop = threading.Event()
    on_stop_signals(lambda *_: stop.set())
    start_lifeline()  # first, and left running: once we exit it kills whatever of the DHT did not stop in time
    identity = node.identity_of(cfg)
    dht = node.start_dht(cfg, identity)
    try:
        path = log_dir / f"{name}.addrs"
        node.write_addresses(dht, path)
        log.info("bootstrap node up; peers join with:\n  %s\n(addresses written to %s)",
                 "\n  ".join(f"p2pdiloco join --initial-peers {a}" for a in node.visible_addresses(dht)), path)
        if reduce:
            from p2pdiloco.swarm.reducer import serve_islands

            serve_islands(dht, identity, cfg, name, stop)
        stop.wait()
    finally:
        node.shutdown(dht)
