"""How a peer's swarm side is put together, in the order the fork needs: the averager's process starts (from
`MergeSettings`, before any model-sized tensor exists), and the merger is built whole later, once the peer's
state and record exist. Each part is made here once and handed in; no constructor starts a process."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from hivemind import DHT

from p2pdiloco.config import OuterConfig, SwarmConfig, merge_rule
from p2pdiloco.core import codec
from p2pdiloco.core.outer import Segment
from p2pdiloco.protocol.island import Bounds
from p2pdiloco.protocol.remote import WIRE_VERSION, Expect
from p2pdiloco.protocol.round import RoundRules, swarm_rules
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.runtime.pace import UploadPace
from p2pdiloco.runtime.paging import PagedStore
from p2pdiloco.swarm.auth import MemberPasses, load_swarm_key
from p2pdiloco.swarm.averager import AveragerLimits, ExactAverager, StateProvider, averager_limits
from p2pdiloco.swarm.node import STOP_WAIT
from p2pdiloco.swarm.records import Heartbeat, LaneBeat
from p2pdiloco.swarm.rounds import SwarmMerger
from p2pdiloco.swarm.statefetch import StateFetcher
from p2pdiloco.swarm.staterelay import StatePusher
from p2pdiloco.swarm.transfer import MAX_PART

WhyNotAdopt = Callable[[dict, list, bool], Optional[str]]  # a validated state too far from ours: why (None: take it)


def averager_prefix(cfg: SwarmConfig, outer: OuterConfig) -> str:
    """The DHT prefix of the run's islands: peers with another merge rule, codec or outer step never meet."""
    return island_prefix(cfg.run_id, merge_rule(cfg, outer))


def island_prefix(run_id: str, settings: dict[str, str]) -> str:
    """The prefix from a peer's published merge settings (config.merge_rule): a reducer node, which has no
    configuration of the model, finds the islands of the swarm it serves from it."""
    s = settings
    sparsity = f"top{s['topk']}" if s["topk"] != "off" else "dense"
    rule = (f"{s['weighting']}_{'rda' if s['rda'] == 'on' else 'mean'}_{s['compression']}_{sparsity}"
            f"_w{s['max_weight_ratio']}_s{s['max_scale_ratio']}_n{s['max_norm_ratio']}_f{s['min_norm_ratio']}_a{s['stale_factor']}"
            f"_i{s['max_influence_ratio']}{'_robust' if s['robust_merge'] == 'on' else ''}"
            f"_o{s['outer_lr']}m{s['outer_momentum']}").replace(".", "p")  # hivemind: no '.' in a prefix
    return f"{run_id}_v{WIRE_VERSION}_{rule}"


@dataclass(frozen=True)
class MergeSettings:
    """What the averager and the merger need of the configs, worked out once."""

    cfg: SwarmConfig
    outer: OuterConfig
    n: int  # parameters: the length of Δ
    segments: tuple[Segment, ...]
    overlap_steps: int  # the next contribution is due this many inner steps after the last
    peer: str  # our peer id
    passes: Optional[MemberPasses] = None  # a swarm with a key: who may join, be merged, fetch our state
    pace: Optional[UploadPace] = None  # the peer's upload cap (--upload-mbps): one for all its averagers

    @functools.cached_property
    def limits(self) -> AveragerLimits:
        return averager_limits(self.n, self.cfg.max_island, self.cfg.link_mbps)

    @property
    def bits(self) -> int:
        return codec.BITS[self.cfg.compression]

    @property
    def credential(self) -> bytes:
        return self.passes.of(self.peer) if self.passes else b""

    @property
    def error_feedback(self) -> bool:
        """On by default where codes drop much (int4 and narrower, top-k)."""
        chosen = self.cfg.error_feedback
        return chosen if chosen is not None else self.bits <= 4 or bool(self.cfg.topk)

    @functools.cached_property
    def rules(self) -> RoundRules:
        cfg, limits = self.cfg, self.limits
        return swarm_rules(
            cfg, self.overlap_steps, grace_floor=limits.matchmaking + 0.5,
            request_timeout=limits.request, allreduce_cap=limits.allreduce_cap, buffer_elements=self.n,
            declared_bytes_per_s=limits.initial_bytes_per_s, rda_segments=self.segments if self.outer.rda else ())

    @property
    def part_timeout(self) -> float:
        """A state part's time: 4× the declared link's time for it."""
        return 5.0 + 4 * 4 * MAX_PART / self.limits.initial_bytes_per_s


def merge_settings(cfg: SwarmConfig, outer: OuterConfig, n_params: int, segments, overlap_steps: int,
                   peer: str, pace: Optional[UploadPace] = None) -> MergeSettings:
    key = load_swarm_key(cfg.swarm_key_file)  # checked when the DHT started
    return MergeSettings(cfg, outer, n_params, tuple(segments), overlap_steps, peer,
                         MemberPasses(key) if key is not None else None, pace)


def start_averager(s: MergeSettings, dht: DHT, share_state: StateProvider, buffer_folder: Optional[Path],
                   make: Callable[..., ExactAverager] = ExactAverager) -> ExactAverager:
    """Build the averager and start its process (a fork: before the model-sized tensors exist)."""
    cfg, outer, limits = s.cfg, s.outer, s.limits
    averager = make(
        s.n, cfg.max_island, share_state, outer.weighting, limits.allreduce_cap,
        Expect(s.n, len(s.segments) if outer.rda else 0), s.bits, cfg.topk,
        Bounds.of(outer),
        cfg.robust_merge, s.passes, buffer_folder,  # in a file there, paged in a piece at a time
        pace=s.pace,
        dht=dht, prefix=averager_prefix(cfg, outer), start=False,
        min_group_size=max(2, cfg.quorum),  # hivemind would "form" a group of 1 at once; K=1 is ours
        min_matchmaking_time=limits.matchmaking, request_timeout=limits.request,
        allreduce_timeout=limits.allreduce_cap, next_chunk_timeout=limits.next_chunk,
        client_mode=cfg.client_mode, allow_state_sharing=not cfg.client_mode, shutdown_timeout=STOP_WAIT)
    averager.run_in_background(await_ready=True)
    return averager


def error_feedback(s: MergeSettings, buffer_folder: Optional[Path]) -> Optional[codec.ErrorFeedback]:
    """The residual waits in a file beside the averaging buffer where the state is parked (4 B/param less)."""
    if not s.error_feedback:
        return None
    store = PagedStore(buffer_folder, "residual-", "error feedback's residual") if buffer_folder else \
        codec.VectorStore()
    return codec.ErrorFeedback(decay=s.cfg.error_feedback_decay, store=store)


def build_merger(s: MergeSettings, dht: DHT, averager: ExactAverager, heartbeat: Heartbeat | LaneBeat,
                 why_not_adopt: WhyNotAdopt, stop: threading.Event, clock: RoundClock,
                 buffer_folder: Optional[Path], make: Callable[..., SwarmMerger] = SwarmMerger) -> SwarmMerger:
    """The merger, whole (`make`: SwarmMerger, or a fault plan's subclass of it)."""
    stub_of = functools.partial(averager.get_stub, namespace=averager.prefix)
    fetcher = StateFetcher(dht, stub_of, s.part_timeout, s.credential)
    # a client serves its state to nobody directly: through a reducer node, to a peer that wants it
    pusher = StatePusher(dht, s.cfg.run_id, s.peer, heartbeat.records, lambda: heartbeat.record.key,
                         averager.get_current_state, stub_of, s.credential) if s.cfg.client_mode else None
    return make(s, dht, averager, heartbeat, fetcher, error_feedback(s, buffer_folder),
                why_not_adopt, stop, clock, pusher)
