"""A reducer node: a public member of islands that only reduces parts (`p2pdiloco bootstrap --reduce`).

Peers behind a NAT join as clients: nobody can dial them, so none of them can reduce a part of a round, and a
swarm made only of home machines would never merge. A reducer node accepts connections and sums the integer codes
of a part, which needs no model: it holds no Θ, no optimizer and no buffer of the model's size, only the pieces
of the parts in flight (p2pdiloco.swarm.codes).

It joins islands in hivemind's auxiliary mode (a public argument of DecentralizedAverager: its all-reduce would
give such a member no weight either), which every member reads from the gathered metadata: the island's plan
(p2pdiloco.protocol.island) gives it a part to reduce and no weight. It checks every part it receives against its
sender's claims and serves the sum as any reducer does, and every member checks that sum: a reducer node cannot
do more than an honest member that reduces. It leads the groups it is in, so that members in client mode find a
leader at all; a group begins once two contributors are in it.

It needs no configuration of the model: it reads the swarm's merge settings from the peers' records (the DHT
prefix of their islands, the model's size, the codec, the bounds) and serves the islands of the most common.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from typing import AsyncIterator, Optional

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from p2pdiloco.config import SwarmConfig
from p2pdiloco.core import codec
from p2pdiloco.protocol.island import Bounds, PenaltyBox, Stragglers
from p2pdiloco.protocol.merge import group_scales, wire_format
from p2pdiloco.protocol.remote import MAX_NORMS, Expect, PeerRecord
from p2pdiloco.protocol.round import IslandReduced
from p2pdiloco.runtime.pace import UploadPace, upload_pace
from p2pdiloco.swarm.auth import MemberPasses, load_swarm_key
from p2pdiloco.swarm.averager import ExactAverager, averager_limits, hivemind_schema
from p2pdiloco.swarm.codes import CodesError
from p2pdiloco.swarm.island_rounds import REFUSE_SECONDS, IslandRounds, claims_for, codes_exchange
from p2pdiloco.swarm.node import STOP_WAIT
from p2pdiloco.swarm.records import DHT_CALL_TIMEOUT, HEARTBEAT, announce_reducer, fetch_records
from p2pdiloco.swarm.signing import Identity
from p2pdiloco.swarm.staterelay import HeldState, serializer
from p2pdiloco.swarm.wiring import island_prefix

log = logging.getLogger("p2pdiloco")

WINDOW = 3.0  # seconds a reducer node's group stays open, from when two trainers look for an island
LOOK_AGAIN = 0.25  # seconds between reads of the trainers' records while fewer than two look
RULE_CHECK = 10.0  # seconds between reads of which merge rule the live trainers publish
STEP_TIMEOUT = WINDOW + 2.0  # one search: too few contributors by then, and the node looks again at once
LAST_CALLS = 1.0  # seconds a cancelled search's calls to the DHT get before the averager stops
MAX_PARAMETERS = 1 << 37  # a published model size beyond this is a liar's: hivemind gets one view per 1 MB of it


@dataclasses.dataclass(frozen=True)
class SwarmMergeRule:
    """What a reducer node must know of the swarm it serves, all from the peers' published settings."""

    prefix: str  # the DHT prefix of its islands
    n: int  # the model's parameters: the length of every contribution
    n_norms: int  # RDA norms per member record
    bits: int
    topk: Optional[float]
    weighting: str
    bounds: Bounds
    robust: bool

    @classmethod
    def of(cls, run_id: str, settings: dict) -> "SwarmMergeRule":
        """Raises KeyError or ValueError where a setting is missing, malformed or out of range (settings come from
        any peer's record)."""
        s = settings
        n, n_norms = int(s["parameters"]), int(s["norms"])
        if not 0 < n <= MAX_PARAMETERS or not 0 <= n_norms <= MAX_NORMS:
            raise ValueError(f"a model of {n} parameters and {n_norms} norms is out of range")
        return cls(island_prefix(run_id, s), n, n_norms, codec.BITS[s["compression"]],
                   None if s["topk"] == "off" else float(s["topk"]), s["weighting"],
                   Bounds(float(s["max_weight_ratio"]), float(s["max_scale_ratio"]), float(s["max_norm_ratio"]),
                          float(s["stale_factor"]), float(s["max_influence_ratio"]), float(s["min_norm_ratio"])),
                   s["robust_merge"] == "on")


def _rules(run_id: str, records: list[PeerRecord]) -> Counter:
    """How many live trainers publish each readable merge rule."""
    rules = Counter()
    for record in records:
        try:
            rules[SwarmMergeRule.of(run_id, record.settings)] += 1
        except (KeyError, ValueError):
            continue
    return rules


def swarm_rule(run_id: str, records: list[PeerRecord]) -> Optional[SwarmMergeRule]:
    """The merge rule most live trainers publish, or None (no trainer yet, or none with readable settings)."""
    rules = _rules(run_id, records)
    return rules.most_common(1)[0][0] if rules else None


def newer_rule(run_id: str, records: list[PeerRecord], current: SwarmMergeRule) -> Optional[SwarmMergeRule]:
    """The rule a node reducing by `current` should reduce by instead, or None: the one most live trainers publish,
    once more of them publish it than `current` (the swarm was restarted with other settings, or the node met a
    misconfigured trainer first). A tie keeps `current`: a node does not flap between the rules of a split swarm."""
    rules = _rules(run_id, records)
    if not rules:
        return None
    best, count = rules.most_common(1)[0]
    return best if best != current and count > rules.get(current, 0) else None


class ReducerAverager(IslandRounds, DecentralizedAverager):
    """The averager of a reducer node: the island rounds of any member (IslandRounds) but its own, which reduces
    its part and sends nothing, and no buffer (hivemind gets the shapes of the swarm's, without their memory)."""

    def __init__(self, rule: SwarmMergeRule, max_group: int, allreduce_cap: float,
                 passes: Optional[MemberPasses] = None, pace: Optional[UploadPace] = None, **kwargs):
        self.rule, self.n_elements, self.max_group = rule, rule.n, max_group
        self.weighting, self.bounds, self.bits, self.topk = rule.weighting, rule.bounds, rule.bits, rule.topk
        self.allreduce_cap, self.expect = allreduce_cap, Expect(rule.n, rule.n_norms)
        self._codes = codes_exchange(rule.n, rule.robust, pace)
        self._passes = passes
        self._refused = PenaltyBox(seconds=REFUSE_SECONDS)
        self._left_out = PenaltyBox(seconds=REFUSE_SECONDS)
        self._stragglers = Stragglers()
        self._held = HeldState(rule.n, passes.valid if passes else None)  # a state relayed for a peer in need
        super().__init__(hivemind_schema(torch.zeros(1).expand(rule.n)), target_group_size=max_group,
                         auxiliary=True, allow_state_sharing=False, **kwargs)

    run_in_background = ExactAverager.run_in_background  # SIGINT stays the node's own (see there)

    def wire_format(self, group_size: int):
        return wire_format(self.bits, self.topk, group_size)

    async def rpc_state_push(self, requests: AsyncIterator[averaging_pb2.DownloadData],
                             context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """A holder's state, for a peer that wants it and can dial nobody else (p2pdiloco.swarm.staterelay)."""
        error = await self._held.receive(requests, str(context.remote_id))
        yield averaging_pb2.DownloadData(metadata=serializer.dumps(dict(error=error)) if error else b"")

    def _serve_part(self, request: averaging_pb2.DownloadData, context: P2PContext):
        """The relayed state's parts, once its holder pushed it (IslandRounds.rpc_state_part let the asker in)."""
        return self._held.serve_part(request)

    async def _island_round(self, group_info) -> IslandReduced:
        self._held.drop_if_idle()  # a relayed state nobody asked for lately: its memory goes back
        island, plan = self._planned(group_info)
        started = time.monotonic()
        self._refuse_left_out(island, plan, group_info)
        me = list(group_info.peer_ids).index(self.peer_id)
        if plan.weights is None or me not in plan.reducers:
            why = plan.reason or "this node reduces no part of this group"
            return self._reduced(island, plan, group_info, False, why, started)
        running = self._running_groups.get(group_info.group_id)  # hivemind's contract: see IslandRounds
        if running is not None and not running.done():
            running.set_result(None)
        ids, included = group_info.peer_ids, plan.included
        scales = group_scales(plan, self.bits)
        levels = codec.levels(self.bits)
        claims = claims_for(plan, included, ids, scales, levels, maxima=levels > 1, floor=not self.topk)
        try:
            dropped = await self._codes.reduce_only(
                group_info.group_id, [ids[i] for i in included], [ids[i] for i in plan.reducers], self.peer_id,
                self.n_elements, self.wire_format(len(included)), plan.deadline, claims)
        except CodesError as e:
            return self._reduced(island, plan, group_info, False, f"reducing our part failed: {e}", started)
        finally:  # what the parts in flight cost us: the node's memory for rounds (docs/internet.md)
            held = self._codes.reductions.get(group_info.group_id)
            log.info("held at most %.1f MB of codes and sums of our part at once",
                     (held.peak_held if held else 0) / 2 ** 20)
        reduced = self._reduced(island, plan, group_info, True, "ok", started)
        return dataclasses.replace(reduced, blamed=self._blame((), dropped), excluded={
            **reduced.excluded, **{peer: f"left out of our part: {why}" for peer, why in dropped.items()}})


# hivemind names a servicer's RPCs after its class ("ExactAverager.rpc_codes_push"): the members call a reducer
# node's by the same names as any member's
ReducerAverager.__name__ = ReducerAverager.__qualname__ = ExactAverager.__name__


def start_reducer(dht: DHT, cfg: SwarmConfig, rule: SwarmMergeRule) -> ReducerAverager:
    key = load_swarm_key(cfg.swarm_key_file)
    limits = averager_limits(rule.n, cfg.max_island, cfg.link_mbps)
    averager = ReducerAverager(
        rule, 1 << cfg.max_island.bit_length(), limits.allreduce_cap, MemberPasses(key) if key is not None else None,
        upload_pace(cfg.upload_mbps),
        dht=dht, prefix=rule.prefix, start=False,
        min_group_size=3,  # itself and two contributors: one contributor alone has nobody to merge with
        min_matchmaking_time=limits.matchmaking, request_timeout=limits.request,
        allreduce_timeout=limits.allreduce_cap, next_chunk_timeout=limits.next_chunk, shutdown_timeout=STOP_WAIT)
    averager.run_in_background(await_ready=True)
    return averager


def serve_islands(dht: DHT, identity: Identity, cfg: SwarmConfig, name: str, stop: threading.Event) -> None:
    """Reduce parts for the swarm's islands until `stop`: once a trainer has published the swarm's merge rule,
    lead a group whenever two trainers are looking for an island, open WINDOW seconds from then to any other that
    comes (for up to twice the largest island a peer seeks: hivemind would have a power of two), and say what
    each round did."""
    rule = None
    while rule is None and not stop.is_set():
        rule = swarm_rule(cfg.run_id, fetch_records(dht, cfg.run_id))
        if rule is None:
            stop.wait(HEARTBEAT)
    if stop.is_set():
        return
    _say_rule(rule)
    averager = start_reducer(dht, cfg, rule)
    announcer = threading.Thread(target=_announce, args=(dht, cfg.run_id, identity, name, stop), daemon=True,
                                 name="reducer-announce")
    announcer.start()
    check_rule = time.monotonic() + RULE_CHECK
    try:
        while not stop.is_set():
            if time.monotonic() >= check_rule:
                check_rule = time.monotonic() + RULE_CHECK
                newer = newer_rule(cfg.run_id, _records(dht, cfg.run_id), rule)
                if newer is not None:  # the averager serves one prefix and one size: a new one for the new rule
                    _say_rule(newer, instead_of=rule)
                    averager.shutdown()
                    rule, averager = newer, start_reducer(dht, cfg, newer)
            if _looking(dht, cfg.run_id) >= 2:
                _one_group(averager, _gather_record(averager, name), stop)
            else:
                stop.wait(LOOK_AGAIN)
    finally:
        averager.shutdown()
        # its last store done before the DHT goes: a call still in the DHT's pipe when this process exits reaches
        # the DHT's process without its reply channel, and hivemind logs a traceback (seen in CI, 2026-11-30)
        announcer.join(DHT_CALL_TIMEOUT)


def _say_rule(rule: SwarmMergeRule, instead_of: Optional[SwarmMergeRule] = None) -> None:
    log.info("reducing parts for the islands of %s (%d parameters, %s)%s", rule.prefix, rule.n,
             "top-k" if rule.topk else f"{rule.bits}-bit codes",
             f", which most live trainers now publish, instead of {instead_of.prefix}" if instead_of else "")


def _gather_record(averager: ReducerAverager, name: str) -> dict:
    """What the node says of itself in a group it leads; whom it blames lives in its averager's process, which
    turns them away from the groups it leads."""
    peer = str(averager.peer_id)
    return dict(peer=peer, name=name, budget=float(averager.allreduce_cap),
                **({"pass": averager._passes.of(peer)} if averager._passes else {}))


def _records(dht: DHT, run_id: str) -> list[PeerRecord]:
    try:
        return fetch_records(dht, run_id)
    except Exception:  # the DHT did not answer in time: nothing to go by this time
        return []


def _looking(dht: DHT, run_id: str) -> int:
    """How many live trainers look for an island now, as their records say. A group opened before the second
    came would begin with one contributor too few, or run out under one that was a moment late; and a node that
    leads while nobody looks only churns the DHT."""
    return sum(r.ready >= 0 for r in _records(dht, run_id))


def _announce(dht: DHT, run_id: str, identity: Identity, name: str, stop: threading.Event) -> None:
    """Say we are up, every beat, until `stop` (for `status`, and for trainers deciding whether to warn)."""
    while not stop.is_set():
        try:
            announce_reducer(dht, run_id, identity, name)
        except Exception:  # the DHT may be shutting down; the next beat retries
            pass
        stop.wait(HEARTBEAT)


def _one_group(averager: ReducerAverager, record: dict, stop: threading.Event) -> None:
    control = averager.step(gather=record, timeout=STEP_TIMEOUT, scheduled_time=get_dht_time() + WINDOW,
                            allow_retries=False, wait=False)
    deadline = time.monotonic() + STEP_TIMEOUT + averager.allreduce_cap
    while not control.done() and time.monotonic() < deadline:
        if stop.is_set() and not control.began_allreduce:  # a round in flight is finished: its members need it
            control.cancel()
            # its matchmaking's last calls to the DHT carry futures whose state our averager's process passes
            # as descriptors: were it gone before the DHT read them, the DHT's process would fail on them
            time.sleep(LAST_CALLS)
            return
        stop.wait(0.1)
    try:
        result = control.result(timeout=0)
    except Exception as e:  # no group this time (fewer than two contributors came): look again
        log.debug("no group: %r", e)
        return
    if isinstance(result, IslandReduced):
        members = ", ".join(m.name or m.peer[-6:] for m in result.members)
        if result.verified:
            log.info("reduced a part for %s in %.1f s", members, result.sync_seconds)
        else:
            log.info("group of %s: %s", members, result.reason)
