"""One round over the swarm, run from DiLoCo's background thread: island, verified exact all-reduce, outcome.

Decoupled mode (the default), no global barrier:
1. catch up first only if needed: a live peer holds a higher state at our version (a fork: everyone moves
   to the highest `lineage_key`) or is more than `max_staleness` versions ahead;
2. quorum: wait until K−1 other peers are looking for an island (K=1: no wait);
3. grace window (Eq. 3, from measured EMAs): how long our matchmaking stays open for more members;
4. exact all-reduce of Δ with weights tokens²/steps (or RDA), verified by every member;
5. members on the group's newest state apply the merge; stale members download that state afterwards.
A peer alone in the swarm (K=1) applies its own update at once. A peer that finds no island while others
are alive rolls back instead: its Δ rides along with its next contribution. Applying it alone would fork Θ,
and the fork's update would be dropped when the forks reconcile.

Sync mode, the baseline: the same, after a barrier on the DHT where everyone waits for everyone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import InvalidStateError
from typing import Callable, Optional, Sequence

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from p2pdiloco.core import exact
from p2pdiloco.runtime import faults
from p2pdiloco.config import OuterConfig, SwarmConfig
from p2pdiloco.core.outer import Segment, rda_combine, rda_directions
from p2pdiloco.runtime.procio import io_counters, moved_since
from p2pdiloco.core.roundtypes import Contribution, MergeOutcome, newest_member
from p2pdiloco.core.state import sharing_priority, validate_state
from p2pdiloco.swarm.averager import ExactAverager, averager_limits, gather_record
from p2pdiloco.swarm.node import STOP_WAIT
from p2pdiloco.swarm.statefetch import StateFetcher
from p2pdiloco.swarm.records import Heartbeat, PeerRecord, fetch_records, wait_for_quorum, wait_for_round
from p2pdiloco.swarm.transfer import MAX_PART
from p2pdiloco.protocol.timing import GracePolicy, RoundClock, allreduce_wire_bytes

logger = get_logger(__name__)
StateTuple = tuple[dict, list[torch.Tensor]]


class SwarmMerger:
    def __init__(self, dht: DHT, cfg: SwarmConfig, outer: OuterConfig, n_params: int,
                 segments: Sequence[Segment], heartbeat: Heartbeat, state_provider: Callable[[], StateTuple],
                 stop: threading.Event, clock: RoundClock, overlap_steps: int):
        self.dht, self.cfg, self.outer, self.n, self.segments = dht, cfg, outer, n_params, list(segments)
        self.heartbeat, self.stop, self.clock, self.overlap_steps = heartbeat, stop, clock, overlap_steps
        self.closed = threading.Event()  # set on shutdown: a round still waiting gives up at once
        self._control = None  # the averager step of the round in flight, once it is looking for a group
        self.buffer_size = n_params + exact.tail_size(cfg.max_island)
        self.limits = averager_limits(self.buffer_size, cfg.max_island, cfg.bandwidth_mbps)
        self.grace_policy = GracePolicy(gamma=cfg.grace_gamma, floor=self.limits.matchmaking + 0.5)
        merge_rule = f"{outer.weighting}_{'rda' if outer.rda else 'mean'}"  # peers with other rules never meet
        self.averager = ExactAverager(
            n_params, cfg.max_island, state_provider, outer.weighting, self.limits.allreduce_cap,
            dht=dht, prefix=f"{cfg.run_id}_{merge_rule}", start=True,
            min_group_size=max(2, cfg.quorum),  # hivemind would "form" a group of 1 at once; K=1 is ours
            min_matchmaking_time=self.limits.matchmaking, request_timeout=self.limits.request,
            allreduce_timeout=self.limits.allreduce_cap, next_chunk_timeout=self.limits.next_chunk,
            allow_state_sharing=True, initial_group_bits=self._group_bits(0), shutdown_timeout=STOP_WAIT,
        )
        self.peer = dht.peer_id.to_base58()
        part_timeout = 5.0 + 4 * 4 * MAX_PART / self.limits.initial_bytes_per_s  # 4× the declared link's time
        self.fetcher = StateFetcher(dht, lambda p2p, peer: self.averager.get_stub(
            p2p, peer, namespace=self.averager.prefix), part_timeout)

    # ---- the round ----------------------------------------------------------------------------------------
    def merge(self, c: Contribution) -> MergeOutcome:
        try:
            return self._merge(c, time.monotonic())
        finally:
            self.heartbeat.update(ready=-1)

    def _merge(self, c: Contribution, start: float) -> MergeOutcome:
        state_before = self._catch_up_first(c)
        if state_before is not None:
            c = dataclasses.replace(c, version=state_before[0]["version"], digest=state_before[0]["digest"])
        extra = dict(state_before=state_before)
        self.heartbeat.update(ready=c.version)
        quorum_seconds, others = self._quorum(c, start)
        extra["quorum_seconds"] = quorum_seconds
        if self.stop.is_set():
            return MergeOutcome.failed("leaving", start, **extra)
        if not others and self.cfg.quorum <= 1:
            return MergeOutcome.solo(c, start, **extra)  # alone in the swarm: K=1 applies its own update
        outcome = self._allreduce(c, start, self.clock.grace(self.overlap_steps, self.grace_policy), extra)
        if not outcome.committed and "could not find a group" in outcome.reason and self.cfg.quorum <= 1:
            if not self.live_others():
                return MergeOutcome.solo(c, start, **extra)  # everyone else left while we looked
        if outcome.committed:
            newest = newest_member(outcome.members)
            if (newest["version"], newest["digest"]) != (c.version, c.digest):
                # we contributed from an older state: the newest members applied the merge; fetch theirs
                outcome.stale = True
                outcome.state = self.download(newest["version"] + 1, "stale contribution")
        return outcome

    def _catch_up_first(self, c: Contribution) -> Optional[StateTuple]:
        others = self.live_others()
        if not others:
            return None
        best = max(others, key=lambda r: r.key)
        behind_limit = 0 if self.cfg.mode == "sync" else self.cfg.max_staleness
        fork = best.version == c.version and best.digest != c.digest and best.key > (c.version, c.digest)
        if fork or best.version > c.version + behind_limit:
            return self.download(best.version, "fork" if fork else "behind")
        return None

    def _quorum(self, c: Contribution, start: float) -> tuple[float, list[PeerRecord]]:
        if self.cfg.mode == "sync":  # everyone waits for everyone at our version
            barrier = wait_for_round(self.dht, self.cfg.run_id, self.peer, c.version,
                                     deadline=start + self.cfg.sync_wait, stop=self.stop)
            return barrier.waited, barrier.expected + barrier.ahead
        deadline = time.monotonic() + self.grace_policy.cap
        return wait_for_quorum(self.dht, self.cfg.run_id, self.peer, self.cfg.quorum - 1, deadline, stop=self.stop)

    def live_others(self) -> list[PeerRecord]:
        return [r for r in fetch_records(self.dht, self.cfg.run_id) if r.peer != self.peer]

    @staticmethod
    def _group_bits(version: int) -> str:
        until = faults.version_of("partition_until")
        return "1" if until is not None and version < until else ""

    def _allreduce(self, c: Contribution, start: float, grace: float, extra: dict) -> MergeOutcome:
        if self._group_bits(c.version) != self._group_bits(0):
            self.averager.set_group_bits(self._group_bits(c.version))
        body, norms = rda_directions(c.delta, self.segments) if self.outer.rda else (c.delta, [])
        with self.averager.get_tensors() as (buffer,):
            buffer[: self.n] = body
        budget = self.clock.allreduce_budget(allreduce_wire_bytes(self.buffer_size, self.cfg.max_island),
                                             self.limits.initial_bytes_per_s)
        gather = gather_record(self.peer, c.name, c.version, c.tokens, c.steps, body, c.digest, budget, norms)
        find_timeout = grace + 2 * self.limits.request + 2.0
        io_before = io_counters(self.averager.pid)
        control = self._control = self.averager.step(gather=gather, weight=1.0, timeout=find_timeout,
                                                     scheduled_time=get_dht_time() + grace, allow_retries=False,
                                                     wait=False)
        try:
            result = result_unless_closed(control, find_timeout + self.limits.allreduce_cap + 5.0, self.closed)
        except Exception as e:  # CancelledError too: we left while looking for an island
            cancel(control)
            extra = dict(extra, **self._traffic(io_before))
            if self.stop.is_set():
                return MergeOutcome.failed("leaving: the round was cancelled", start, **extra)
            return MergeOutcome.failed(f"all-reduce failed: {type(e).__name__}: {e}", start, **extra)
        finally:
            self._control = None
        extra = dict(extra, **self._traffic(io_before))
        if not result or not result.get("verified"):
            reason = result.get("reason", "no result") if result else "no group"
            return MergeOutcome.failed(f"round discarded: {reason}", start, **extra)
        with self.averager.get_tensors() as (buffer,):
            merged = buffer[: self.n].clone()
        members = result["members"]
        try:
            if self.outer.rda:
                merged = rda_combine(merged, [m["norms"] for m in members], result["weights"], self.segments)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            return MergeOutcome.failed(f"round discarded: malformed RDA norms ({e})", start, **extra)
        if not bool(torch.isfinite(merged).all()):
            return MergeOutcome.failed("round discarded: merged update is not finite", start, **extra)
        wire = allreduce_wire_bytes(self.buffer_size, len(members))
        sync_seconds = float(result.get("sync_seconds", 0.0))
        if wire and sync_seconds > 0:
            self.clock.throughput.update(wire / sync_seconds)
        return MergeOutcome(merged=merged, members=members, weights=result["weights"], group_id=result["group_id"],
                            reason="ok",
                            seconds=time.monotonic() - start, sync_seconds=sync_seconds, allreduce_bytes_model=wire,
                            deadline_seconds=float(result.get("deadline", 0.0)),
                            **extra)

    def _traffic(self, before) -> dict:
        """What this round really moved (failed rounds too), measured on our averager process."""
        moved = moved_since(self.averager.pid, before)
        return {} if moved is None else dict(bytes_sent=moved.written, bytes_received=moved.read)

    def leave_round(self) -> bool:
        """The peer is leaving: cancel the round in flight if it is still looking for an island (no member
        depends on our data yet), and say so. A round already exchanging tensors is left to finish: leaving
        it would make the whole island roll back."""
        control = self._control
        if control is None or control.began_allreduce:
            return False
        cancel(control)
        return True

    # ---- global state from peers --------------------------------------------------------------------------
    def download(self, min_version: int, why: str, timeout: Optional[float] = None) -> Optional[StateTuple]:
        """The newest state from the swarm, at least `min_version`, validated. A donor that is older (right
        after a round the members that apply the merge publish it a moment later), dies mid-transfer or
        sends garbage is retried, next time from the best donor then, until the deadline."""
        deadline = time.monotonic() + (timeout or max(10.0, self.limits.allreduce_cap))
        while True:
            loaded = self._from_donors(min_version, deadline)
            if loaded is None:  # one donor at a time, hivemind's way
                loaded = self.load_state(timeout=max(1.0, deadline - time.monotonic()))
            problem = "no peer shared its state" if loaded is None else validate_state(*loaded, self.n, min_version)
            if not problem:
                return loaded
            if time.monotonic() >= deadline or self.stop.is_set() or self.closed.is_set():
                logger.info(f"state download ({why}) failed: {problem}")
                return None
            time.sleep(0.5)

    def _from_donors(self, min_version: int, deadline: float) -> Optional[StateTuple]:
        """In parts from every live peer announcing the best state key, resuming past donors that fail."""
        records = [r for r in self.live_others() if r.version >= min_version]
        if not records:
            return None
        best = max(r.key for r in records)
        donors = [r.peer for r in records if r.key == best]
        try:
            t = self.fetcher.fetch(donors, best, 2 * self.n, timeout=max(1.0, deadline - time.monotonic()))
        except Exception as e:  # every donor failed, or time ran out: the caller falls back
            logger.info(f"state from {len(donors)} donor(s) failed: {type(e).__name__}: {e}")
            return None
        failed = f"; {t.requeued_parts} part(s) re-fetched after {sorted(t.failed_donors)} failed" \
            if t.failed_donors else ""
        logger.info(f"state v{best[0]} from {len(donors)} donor(s), parts {dict(t.parts_by_donor)}{failed}")
        return t.metadata, [t.flat[: self.n], t.flat[self.n:]]

    def load_state(self, timeout: float) -> Optional[StateTuple]:
        try:
            loaded = self.averager.load_state_from_peers(timeout=timeout)
        except Exception as e:  # a hostile or dying donor: report, never crash
            logger.info(f"state download failed: {type(e).__name__}: {e}")
            return None
        return None if loaded is None else (loaded[0], list(loaded[1]))

    def publish_state(self, version: int, state_digest: str, sketch: list[float]) -> None:
        """After every change of Θ: donors are ranked by the same order peers reconcile by."""
        self.averager.state_sharing_priority = sharing_priority(version, state_digest)
        self.heartbeat.update(version=version, digest=state_digest, sketch=sketch)

    def shutdown(self) -> None:
        self.closed.set()  # before the averager goes: its pending step would never resolve
        self.fetcher.close()
        if self.averager.is_alive():
            self.averager.shutdown()


def result_unless_closed(future, timeout: float, closed: threading.Event, poll: float = 0.25):
    """`future.result(timeout)`, but raise as soon as `closed` is set: the peer is leaving, and an outcome
    that can no longer arrive must not keep its process alive."""
    deadline = time.monotonic() + timeout
    while True:
        if closed.is_set():
            raise LeavingError("the peer is leaving")
        try:
            return future.result(timeout=max(0.0, min(poll, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise


class LeavingError(RuntimeError):
    pass


def cancel(control) -> None:
    """Cancel an averager step; a second cancel (or one after it finished) is a no-op, not an error."""
    with contextlib.suppress(InvalidStateError):
        control.cancel()
