"""The one subclass of hivemind's DecentralizedAverager: exact, verified rounds and state sharing, split by
process. Here is what the host (the training process) imports and calls: the averager's construction and its
limits, the shared buffer, the gathered record of a round (`gather_record`, of p2pdiloco.protocol.merge's `BodyStatistics`) and the state it
serves from the host. What runs in the averager's own process, forked by hivemind (the island's round after
matchmaking, our RPCs and hooks on hivemind's), is p2pdiloco.swarm.island_rounds. Every wire format goes through
our own exact sums: hivemind's fp32 all-reduce is not used. Every seam below hivemind's public API is listed with
its test in p2pdiloco.swarm.seams; tests/unit/test_averager_seams.py drives the RPC hooks without a network.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.utils.logging import get_logger

from p2pdiloco.core import codec
from p2pdiloco.protocol.island import Bounds, PenaltyBox, Stragglers
from p2pdiloco.protocol.merge import BodyStatistics, wire_format
from p2pdiloco.protocol.remote import Expect
from p2pdiloco.protocol.timing import allreduce_wire_bytes
from p2pdiloco.runtime.pace import UploadPace
from p2pdiloco.runtime.paging import FileVectors
from p2pdiloco.swarm.auth import MemberPasses
from p2pdiloco.swarm.island_rounds import REFUSE_SECONDS, IslandRounds, codes_exchange

logger = get_logger(__name__)

AVERAGED_CHUNK = 1 << 18  # elements per tensor handed to hivemind (1 MB; even the test models span several)

StateProvider = Callable[[], tuple[dict, Sequence[torch.Tensor]]]


@dataclass(frozen=True)
class AveragerLimits:
    """hivemind's construction-time limits. The all-reduce one is only an outer cap: each round's deadline
    comes from the link speed this peer measured (RoundClock.allreduce_budget), sent along in the gathered
    metadata and enforced in `_aggregate_with_group`, so it follows the network as it changes."""

    allreduce_cap: float
    next_chunk: float
    matchmaking: float  # hivemind's min_matchmaking_time: the floor of the grace window
    request: float
    initial_bytes_per_s: float  # link speed assumed until the first round has been measured


def averager_limits(n_elements: int, max_group: int, bandwidth_mbps: float, part_bytes: int = 1 << 19,
                    cpu_seconds_per_gb: float = 4.0) -> AveragerLimits:
    """From the payload size and the declared link: the butterfly moves 2·(N−1)/N·S bytes per peer, plus CPU
    time for (de)serialization (measured ~0.6 s per 40 MB with 2 peers on 2 cores)."""
    link = bandwidth_mbps * 1e6 / 8
    cpu_rate = 1e9 / (cpu_seconds_per_gb * max_group)
    effective = 1.0 / (1.0 / link + 1.0 / cpu_rate)
    expected = allreduce_wire_bytes(n_elements, max_group) / effective
    request = 2.0
    return AveragerLimits(allreduce_cap=math.ceil(30.0 + 10.0 * expected),
                          next_chunk=max(2.0, 10.0 * part_bytes / link), matchmaking=request + 0.5,
                          request=request, initial_bytes_per_s=effective)


class ExactAverager(IslandRounds, DecentralizedAverager):
    """Merges one flat fp32 buffer, shared with the host. What the host calls is here; what runs in the averager's
    own process (the island's round, the RPCs) is `IslandRounds` (p2pdiloco.swarm.island_rounds).

    The host writes Δ into it, calls `step(weight=1, gather=...)`; on return it holds the exact token-weighted
    sum Σ wᵢΔᵢ when `result["verified"]` is True. Otherwise it holds nothing of use: the host keeps its Δ and
    writes it again for its next attempt (no model-sized copy of it here).
    """

    def __init__(self, n_elements: int, max_group: int, state_provider: StateProvider, weighting: str,
                 allreduce_cap: float, expect: Expect, bits: int = codec.BITS["none"], topk: Optional[float] = None,
                 bounds: Bounds = Bounds(), robust: bool = False, passes: Optional[MemberPasses] = None,
                 buffer_folder: Optional[Path] = None, pace: Optional[UploadPace] = None, **kwargs):
        self.n_elements, self.max_group, self.weighting, self.bounds = n_elements, max_group, weighting, bounds
        self.allreduce_cap, self.expect = allreduce_cap, expect
        self.bits = bits  # codes' width on the wire (swarm.codes)
        self.topk = topk  # send only this fraction of each block (codec.TopKFormat)
        self._codes = codes_exchange(n_elements, robust, pace)  # `pace`: the peer's upload cap, shared
        self._state_provider = state_provider
        self._passes = passes  # a swarm with a key: who may join our group, be merged, fetch our state
        self._refused = PenaltyBox(seconds=REFUSE_SECONDS)  # members we turn away at matchmaking, for a while
        self._left_out = PenaltyBox(seconds=REFUSE_SECONDS)  # members our island left out: we do not follow them
        self._stragglers = Stragglers()  # members whose part came after our cut-off: blamed when late again
        # the host and our streams read and write the flat buffer as one, in a file mapped shared where a folder
        # is given (paged in a piece at a time), in shared memory otherwise: the forked process shares it either way
        self._paged = _paged_buffer(n_elements, buffer_folder)
        self._flat = self._paged.vectors[0] if self._paged is not None else torch.zeros(n_elements).share_memory_()
        super().__init__(hivemind_schema(self._flat), target_group_size=max_group, **kwargs)

    @contextlib.contextmanager
    def buffer(self):
        """The whole averaged buffer, under hivemind's tensor lock."""
        with self.get_tensors():
            yield self._flat

    def let_go(self, part: slice) -> None:
        """Let elements `part` of the buffer go from this process's memory, if it lives in a file (a pass over it
        calls this as it goes: the host's as it writes Δ and reads the sum, ours as pieces are coded and land)."""
        if self._paged is not None:
            self._paged.let_go(part)

    def wire_format(self, group_size: int):
        return wire_format(self.bits, self.topk, group_size)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind==1.1.12 sets SIGINT to ignored in the *host* process here, before starting the child, so a
        peer would never see Ctrl-C again; the child ignores it in `run` instead (a Ctrl-C is for the peer,
        which leaves in order and shuts us down)."""
        no_group_is_news()
        self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def get_current_state(self):
        """Runs in the host process when a peer downloads our state (late join, resync)."""
        metadata, tensors = self._state_provider()
        return metadata, list(tensors), None















def hivemind_schema(buffer: torch.Tensor) -> list[torch.Tensor]:
    """What hivemind gets as its averaged tensors: the buffer's 1 MB views' shapes, without their memory.
    Its matchmaking takes only followers whose tensors' shapes hash like the leader's (the same hash as the
    views themselves: peers of earlier versions handed those); it never reads their values, since our rounds
    travel through rpc_codes_* and our state through rpc_download_state. It would move real views into
    /dev/shm (share_memory_ under its file_system strategy), copying a buffer that lives in a file."""
    shape_only = torch.zeros(1)  # one element for all: share_memory_ moves 4 bytes, once
    return [shape_only.expand(view.shape) for view in buffer.split(AVERAGED_CHUNK)]


def _paged_buffer(n: int, folder: Optional[Path]) -> Optional[FileVectors]:
    """The buffer in a file of `folder` (None: in memory; also where the folder cannot hold it, saying so)."""
    if folder is None:
        return None
    try:
        return FileVectors(n, 1, folder, prefix="averaging-")
    except (OSError, ValueError) as e:
        logger.warning(f"cannot keep the averaging buffer in {folder} ({e}): it stays in memory ({4 * n / 1e9:.2f} GB)")
        return None


def gather_record(peer: str, name: str, version: int, tokens: int, steps: int, statistics: BodyStatistics,
                  digest: str, budget: float, norms: Sequence[float] = (), blame: Sequence[str] = (),
                  credential: bytes = b"") -> dict:
    """This member's metadata for the round, all-gathered during matchmaking (kept small: ~4 bytes per
    16K parameters for each block statistic, one float per tensor for RDA norms)."""
    return dict(peer=peer, name=name, version=version, tokens=int(tokens), steps=int(steps), digest=digest,
                budget=float(budget), norms=[float(x) for x in norms], maxabs=statistics.statistic.numpy().tobytes(),
                block_norms=statistics.norms.numpy().tobytes(),
                blame=list(blame), **({"pass": credential} if credential else {}))


class _NoGroupIsNews(logging.Filter):
    """A search that ends without a group is a round's outcome, which the round's own line says: not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "could not find a group" not in record.getMessage()


def no_group_is_news() -> None:
    """hivemind logs each search that found no group with its traceback, from the averager's process (which
    inherits this filter as it forks): a peer alone, or a node between islands, would fill its log with them."""
    averager_log = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(f, _NoGroupIsNews) for f in averager_log.filters):
        averager_log.addFilter(_NoGroupIsNews())
