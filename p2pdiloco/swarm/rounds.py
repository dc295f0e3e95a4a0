"""One synchronous round over the swarm: barrier on the DHT, verified exact all-reduce, outcome.

The DiLoCo side sees only `merge(...) -> MergeOutcome`; `p2pdiloco.peer.SoloMerger` is the same interface
without a network, which is what unit tests and a swarm of one use.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch
from hivemind import DHT
from hivemind.utils.logging import get_logger

from p2pdiloco import exact
from p2pdiloco.config import SwarmConfig
from p2pdiloco.roundtypes import Contribution, MergeOutcome
from p2pdiloco.swarm.averager import ExactAverager, gather_record, round_timeouts
from p2pdiloco.swarm.records import Heartbeat, wait_for_round

logger = get_logger(__name__)


class SwarmMerger:
    def __init__(self, dht: DHT, cfg: SwarmConfig, n_params: int, heartbeat: Heartbeat, state_provider,
                 stop: threading.Event):
        self.dht, self.cfg, self.n, self.heartbeat, self.stop = dht, cfg, n_params, heartbeat, stop
        self.timeouts = round_timeouts(n_params + exact.tail_size(cfg.max_island), cfg.max_island,
                                       cfg.bandwidth_mbps)
        self.averager = ExactAverager(
            n_params, cfg.max_island, state_provider, dht=dht, prefix=f"{cfg.run_id}_round", start=True,
            min_group_size=max(2, cfg.quorum),  # hivemind forms groups of 1 at once; K=1 is ours min_matchmaking_time=self.timeouts.matchmaking,
            request_timeout=self.timeouts.request, allreduce_timeout=self.timeouts.allreduce,
            next_chunk_timeout=self.timeouts.next_chunk, allow_state_sharing=True,
        )
        self.peer = dht.peer_id.to_base58()

    def merge(self, c: Contribution) -> MergeOutcome:
        start = time.monotonic()
        self.heartbeat.update(ready=c.version)
        barrier = wait_for_round(self.dht, self.cfg.run_id, self.peer, c.version,
                                 deadline=time.monotonic() + self.cfg.sync_wait, stop=self.stop)
        if barrier.ahead:
            return MergeOutcome.failed("behind: peers are at a newer version", start, behind=True)
        if not barrier.expected and self.cfg.quorum <= 1:
            return MergeOutcome.solo(c, start)  # nobody else alive: K=1 applies its own update
        return self._allreduce(c, start)

    def _allreduce(self, c: Contribution, start: float) -> MergeOutcome:
        with self.averager.get_tensors() as (buffer,):
            buffer[: self.n] = c.delta
        gather = gather_record(self.peer, c.name, c.version, c.tokens, c.steps, c.delta, c.digest)
        try:
            result = self.averager.step(gather=gather, weight=1.0, timeout=self.timeouts.step,
                                        allow_retries=False)
        except Exception as e:
            if self.cfg.quorum <= 1 and "could not find a group" in str(e):
                return MergeOutcome.solo(c, start)  # nobody came: K=1 applies its own update
            return MergeOutcome.failed(f"all-reduce failed: {type(e).__name__}: {e}", start)
        if not result or not result.get("verified"):
            reason = result.get("reason", "no result") if result else "no group"
            return MergeOutcome.failed(f"round discarded: {reason}", start)
        with self.averager.get_tensors() as (buffer,):
            merged = buffer[: self.n].clone()
        members = result["members"]
        return MergeOutcome(merged=merged, members=members, group_id=result["group_id"], reason="ok",
                            seconds=time.monotonic() - start,
                            bytes_estimate=_allreduce_bytes(self.n + exact.tail_size(self.cfg.max_island),
                                                            len(members)))

    def load_state(self, timeout: float) -> Optional[tuple[dict, list[torch.Tensor]]]:
        loaded = self.averager.load_state_from_peers(timeout=timeout)
        return None if loaded is None else (loaded[0], list(loaded[1]))

    def set_sharing(self, allowed: bool, version: int) -> None:
        self.averager.state_sharing_priority = float(version + 1)
        self.averager.allow_state_sharing = allowed

    def shutdown(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()


def _allreduce_bytes(n_elements: int, group_size: int) -> int:
    """Bytes this peer sends (and receives) in a butterfly all-reduce of fp32 values."""
    return int(2 * (group_size - 1) / group_size * 4 * n_elements)
