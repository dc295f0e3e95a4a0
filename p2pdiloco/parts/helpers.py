"""The helper processes, started before any model-sized tensor exists: the lifeline, the DHT and the averager."""

from __future__ import annotations

import gc
import logging
import subprocess
from dataclasses import dataclass
from typing import Callable, Optional

from p2pdiloco.config import PeerConfig
from p2pdiloco.parts.workload import Workload, parking_folder
from p2pdiloco.runtime.lifeline import start_lifeline
from p2pdiloco.runtime.pace import upload_pace
from p2pdiloco.swarm import node
from p2pdiloco.swarm.averager import ExactAverager
from p2pdiloco.swarm.wiring import MergeSettings, merge_settings, start_averager

log = logging.getLogger("p2pdiloco")


@dataclass(frozen=True)
class Helpers:
    lifeline: Optional[subprocess.Popen]  # kills the others should this process die (runtime.lifeline)
    dht: object  # hivemind.DHT
    averager: ExactAverager
    settings: MergeSettings
    identity: object  # p2pdiloco.swarm.signing.Identity: our peer id's key, which signs our records

    @property
    def peer_id(self) -> str:
        return self.settings.peer


def start_helpers(cfg: PeerConfig, workload: Workload, share_state: Callable,
                  make_averager: Callable[..., ExactAverager] = ExactAverager,
                  leaving: Callable[[], bool] = lambda: False) -> Helpers:
    # first: whatever the DHT spawns is taken down with us, even if we die (or leave) while it starts
    lifeline = start_lifeline()
    # the helpers fork from us next: objects made so far (the imports: transformers alone brings 1,713 modules)
    # leave the collector's generations, or each child's collections would touch, and so copy, every page that
    # holds one (the tiny peer's peak: 1.14 GB against 1.25, one run each)
    gc.collect()
    gc.freeze()
    identity = node.identity_of(cfg.swarm)
    dht = node.start_dht(cfg.swarm, identity, leaving=leaving)
    try:
        overlap = cfg.swarm.overlap_steps or cfg.inner.steps  # the next contribution is due H steps later
        settings = merge_settings(cfg.swarm, cfg.outer, workload.n_params, workload.segments, overlap,
                                  node.peer_id(dht), upload_pace(cfg.swarm.upload_mbps))
        averager = start_averager(settings, dht, share_state, parking_folder(cfg, workload.n_params), make_averager)
    except BaseException:
        node.shutdown(dht)
        raise
    return Helpers(lifeline, dht, averager, settings, identity)


def announce(cfg: PeerConfig, helpers: Helpers, name: str) -> None:
    """Our addresses, in a file for launchers and, for the first peer, in the log for people."""
    addresses = cfg.log_dir / f"{name}.addrs"
    node.write_addresses(helpers.dht, addresses)
    if cfg.swarm.client_mode:
        log.info("reachable: no, in client mode (nobody dials this peer; it merges through public peers or "
                 "reducer nodes)")
    else:
        log.info("reachable: yes, accepting connections at %s", ", ".join(node.visible_addresses(helpers.dht)))
    if not cfg.swarm.initial_peers:
        log.info("started a new swarm; others join with:\n  %s\n(addresses written to %s)",
                 "\n  ".join(f"p2pdiloco join --initial-peers {a}" for a in node.visible_addresses(helpers.dht)),
                 addresses)
