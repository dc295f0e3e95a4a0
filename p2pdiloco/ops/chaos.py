"""Chaos over a local swarm: SIGKILL peers at chosen phases of a round, freeze others with SIGSTOP, restart
the killed ones, add newcomers; bounded in time and in count, and every process stopped by PID tree.

Phases are read from each peer's own JSONL: `joining` (spawned, not training yet: downloading state),
`in_round` (a contribution handed over and not settled: island forming or all-reduce) and `training`.
Every action is logged to LOG_DIR/chaos-events.jsonl; `swarmreport` turns the logs into goodput, uptime,
stalls and agreement figures. Restarted peers and newcomers join through a random live peer, never
necessarily the bootstrap node.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from p2pdiloco.ops.launcher import join_command, start_bootstrap, start_process, stop_tree
from p2pdiloco.runtime.lifeline import children, descendants
from p2pdiloco.runtime.metrics import read_jsonl
from p2pdiloco.runtime.schema import Record, parse_records, read_records
from p2pdiloco.ops.swarmreport import Life, split_lives, summarize

PHASES = ("training", "in_round", "joining")
KILL_TARGETS = ("peer", "worker")
STEP_WINDOW = 10  # inner steps per `window` record (peer.WINDOW, kept here to avoid importing torch)


@dataclass(frozen=True)
class ChaosPlan:
    peers: int = 5
    seconds: float = 600.0
    kill_every: float = 30.0  # mean seconds between SIGKILLs (each gap uniform in [0.5, 1.5]×); 0: never
    freeze_every: float = 90.0  # SIGSTOP a whole peer tree for `freeze_seconds`; 0: never
    freeze_seconds: tuple[float, float] = (5.0, 20.0)
    restart_after: tuple[float, float] = (2.0, 10.0)  # a killed peer comes back (same name, own checkpoint)
    # what a kill takes: "peer", the whole process tree (a machine lost: it comes back after `restart_after`);
    # "worker", the supervised peer's own process and its helpers (a crash: its supervisor forks the next life);
    # "mixed", the two in turn
    kill: str = "peer"
    add_every: float = 150.0  # a newcomer joins; 0: never
    max_peers: int = 6  # slots, newcomers included
    min_alive: int = 2  # never kill or freeze below this many running, unfrozen peers
    quiet_tail: float = 0.0  # the last seconds without faults, for the swarm to settle
    phase_wait: float = 8.0  # how long a kill may wait for a peer in the phase it drew
    freeze_precedence: float = 20.0  # how long kills hold back while a due freeze waits for enough trainers
    seed: int = 0

    @property
    def failure_free(self) -> "ChaosPlan":
        return ChaosPlan(peers=self.peers, seconds=self.seconds, kill_every=0, freeze_every=0, add_every=0,
                         max_peers=self.peers, seed=self.seed)


class Slot:
    def __init__(self, name: str):
        self.name = name
        self.proc: Optional[subprocess.Popen] = None
        self.spawns: list[float] = []
        self.frozen_since: Optional[float] = None
        self.freeze_for = 0.0
        self.frozen_tree: dict[int, int] = {}
        self.restart_at: Optional[float] = None
        self.started = False  # this life has begun training (seen its `start` record)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def available(self) -> bool:  # running and not frozen: can be killed, frozen, or joined through
        return self.running and self.frozen_since is None


class Chaos:
    def __init__(self, plan: ChaosPlan, log_dir: Path, join_args: list[str], run_id: str = "chaos"):
        self.plan, self.log_dir, self.run_id = plan, log_dir, run_id
        self.join_args = join_args
        self.rng = random.Random(plan.seed)
        self.slots: dict[str, Slot] = {}
        self.bootstrap: Optional[subprocess.Popen] = None
        self.address = ""
        self.events_path = log_dir / "chaos-events.jsonl"
        self.kills = 0

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> dict:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for stale in (*self.log_dir.glob("*.jsonl"), *self.log_dir.glob("*.addrs")):
            stale.unlink()
        try:
            self.bootstrap, self.address = start_bootstrap(self.log_dir, ["--run-id", self.run_id])
            self.start = time.time()
            self._event("begin", None)
            for i in range(self.plan.peers):
                self._spawn(f"peer{i}")
            self._loop()
            self.end = time.time()
            self._event("end", None)
        finally:
            self._stop_everything()
        return self.report()

    def _loop(self) -> None:
        p, now = self.plan, time.time()
        faults_until = self.start + p.seconds - p.quiet_tail
        next_kill = self._next(now, p.kill_every)
        next_freeze = self._next(now, p.freeze_every)
        next_add = self._next(now, p.add_every)
        freeze_due_since: Optional[float] = None
        while (now := time.time()) < self.start + p.seconds:
            self._restart_exited(now)
            for slot in self.slots.values():
                if slot.frozen_since is not None and now >= slot.frozen_since + slot.freeze_for:
                    self._thaw(slot)
                if slot.restart_at is not None and now >= slot.restart_at:
                    self._spawn(slot.name)
            if now < faults_until:
                # a fault the floor of live peers forbade now is retried shortly; a freeze refused for want of
                # trainers holds kills back a while (kills of joining peers would otherwise keep the trainers
                # below the floor, and a run could draw no freeze at all)
                if now >= next_freeze:
                    frozen = self._freeze()
                    freeze_due_since = None if frozen else (freeze_due_since or now)
                    next_freeze = self._next(now, p.freeze_every) if frozen else now + 2.0
                kills_held = freeze_due_since is not None and now < freeze_due_since + p.freeze_precedence
                if now >= next_kill and not kills_held:
                    next_kill = self._next(now, p.kill_every) if self._kill_in_phase(now) else now + 2.0
                if now >= next_add:
                    if len(self.slots) < p.max_peers:
                        self._spawn(f"new{len(self.slots) - p.peers}")
                    next_add = self._next(now, p.add_every)
            time.sleep(0.2)

    def _next(self, now: float, every: float) -> float:
        return now + every * self.rng.uniform(0.5, 1.5) if every > 0 else float("inf")

    # ---- actions ---------------------------------------------------------------------------------------
    def _spawn(self, name: str) -> None:
        slot = self.slots.setdefault(name, Slot(name))
        via = self._live_addresses(exclude=name)
        cmd = join_command(via, name, self.log_dir, "--max-time", str(self.plan.seconds + 300), *self.join_args,
                           run_id=self.run_id, checkpoint_dir=self.log_dir / "checkpoints")
        slot.proc = start_process(cmd, self.log_dir / f"{name}.log")
        slot.spawns.append(time.time())
        slot.restart_at, slot.started = None, False
        self._event("spawn", name, via="bootstrap" if via == [self.address] else "peer")

    def _live_addresses(self, exclude: str, most: int = 3) -> list[str]:
        """A few random live peers' addresses (bootstrap independence; a restart takes seconds, and any one of
        them may die meanwhile), falling back on the bootstrap node."""
        live = []
        for slot in self.slots.values():
            addrs = self.log_dir / f"{slot.name}.addrs"
            if slot.name != exclude and slot.available and addrs.exists() and slot.spawns \
                    and addrs.stat().st_mtime >= slot.spawns[-1] and addrs.read_text().strip():
                live.append(addrs.read_text().split()[0])
        return self.rng.sample(live, min(most, len(live))) if live else [self.address]

    def _restart_exited(self, now: float) -> None:
        """A peer that exited by itself (e.g. every peer it was told to join through died before it dialed)
        is restarted like a killed one, as a supervisor would; its exit ends that life."""
        for slot in self.slots.values():
            if slot.proc is not None and slot.restart_at is None and slot.frozen_since is None and not slot.running:
                slot.restart_at = now + self.rng.uniform(*self.plan.restart_after)
                self._event("exit", slot.name, returncode=slot.proc.returncode)

    def _kill_in_phase(self, now: float) -> bool:
        """Draw a phase, wait a little for a peer in it, kill one (any, if none came): never a trainer if
        that would leave fewer than `min_alive` of them."""
        want = self.rng.choice(PHASES)
        deadline = now + self.plan.phase_wait
        while not (in_phase := [s for s in self._candidates() if self.phase(s) == want]):
            if time.time() >= deadline:
                break
            time.sleep(0.5)
        trainers = [s for s in self._candidates() if self.phase(s) != "joining"]
        pool = [s for s in (in_phase or self._candidates())
                if self.phase(s) == "joining" or len(trainers) > self.plan.min_alive]
        if not pool:
            return False
        victim = self.rng.choice(pool)
        return self._kill(victim, self.phase(victim), wanted=want)

    def _candidates(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.available]

    def _kill(self, slot: Slot, phase: str, wanted: str) -> bool:
        target = KILL_TARGETS[self.kills % len(KILL_TARGETS)] if self.plan.kill == "mixed" else self.plan.kill
        killed = (self._kill_worker if target == "worker" else self._kill_peer)(slot, phase, wanted)
        self.kills += killed
        return killed

    def _kill_peer(self, slot: Slot, phase: str, wanted: str) -> bool:
        tree = {slot.proc.pid: 0, **descendants(slot.proc.pid)}
        for pid in tree:
            _signal(pid, signal.SIGKILL)
        slot.proc.wait()
        slot.restart_at = time.time() + self.rng.uniform(*self.plan.restart_after)
        self._event("kill", slot.name, phase=phase, wanted=wanted, target="peer")
        return True

    def _kill_worker(self, slot: Slot, phase: str, wanted: str) -> bool:
        """SIGKILL the life its supervisor forked, and that life's helpers: the supervisor forks the next one at
        once, so the next life is counted from the kill."""
        workers = children(slot.proc.pid)
        if not workers:  # between two lives
            return False
        for worker in workers:
            for pid in {worker: 0, **descendants(worker)}:
                _signal(pid, signal.SIGKILL)
        self._event("kill", slot.name, phase=phase, wanted=wanted, target="worker")
        slot.spawns.append(time.time())
        slot.started = False
        self._event("spawn", slot.name, via="supervisor")
        return True

    def _freeze(self) -> bool:
        candidates = [s for s in self._candidates() if self.phase(s) != "joining"]
        if len(candidates) <= self.plan.min_alive:
            return False
        slot = self.rng.choice(candidates)
        slot.freeze_for = self.rng.uniform(*self.plan.freeze_seconds)
        slot.frozen_since = time.time()
        slot.frozen_tree = {slot.proc.pid: 0, **descendants(slot.proc.pid)}
        for pid in slot.frozen_tree:
            _signal(pid, signal.SIGSTOP)
        self._event("freeze", slot.name, phase=self.phase(slot), seconds=round(slot.freeze_for, 1))
        return True

    def _thaw(self, slot: Slot) -> None:
        for pid in slot.frozen_tree:
            _signal(pid, signal.SIGCONT)
        slot.frozen_since = None
        self._event("thaw", slot.name)

    def _stop_everything(self) -> None:
        for slot in self.slots.values():
            if slot.frozen_since is not None:
                self._thaw(slot)
        running = [s for s in self.slots.values() if s.running]
        for slot in running:
            slot.proc.send_signal(signal.SIGTERM)  # all leave at once: each saves and reports
        for slot in running:
            stop_tree(slot.proc, grace=30, already_signalled=True)
        if self.bootstrap is not None:
            stop_tree(self.bootstrap)

    # ---- observation -----------------------------------------------------------------------------------
    def phase(self, slot: Slot) -> str:
        records = [r for r in _tail_records(self.log_dir / f"{slot.name}.jsonl") if r.time >= slot.spawns[-1]]
        slot.started = slot.started or any(r.kind == "start" for r in records)
        if not slot.started:
            return "joining"
        last_contribute = max((r.time for r in records if r.kind == "contribute"), default=-1.0)
        last_round = max((r.time for r in records if r.kind == "round"), default=-1.0)
        return "in_round" if last_contribute > last_round else "training"

    def _event(self, event: str, peer: str, **fields) -> None:
        with self.events_path.open("a") as f:
            f.write(json.dumps(dict(time=round(time.time(), 3), event=event, peer=peer, **fields)) + "\n")

    # ---- report ----------------------------------------------------------------------------------------
    def lives(self) -> list[Life]:
        return lives_from_logs(self.log_dir)

    def report(self) -> dict:
        return report_from_logs(self.log_dir, self.plan.peers)


def lives_from_logs(log_dir: Path) -> list[Life]:
    """Every process life of a finished (or still running) chaos run, rebuilt from its event log."""
    events = read_jsonl(log_dir / "chaos-events.jsonl")
    end = next((e["time"] for e in events if e["event"] == "end"), time.time())
    spawns: dict[str, list[float]] = {}
    deaths: dict[str, list[Optional[float]]] = {}
    frozen: dict[str, list[tuple[float, float]]] = {}
    since: dict[str, float] = {}
    for e in events:
        name = e.get("peer")
        if e["event"] == "spawn":
            spawns.setdefault(name, []).append(e["time"])
            deaths.setdefault(name, []).append(None)
        elif e["event"] in ("kill", "exit"):
            deaths[name][-1] = e["time"]
        elif e["event"] == "freeze":
            since[name] = e["time"]
        elif e["event"] == "thaw" and name in since:
            frozen.setdefault(name, []).append((since.pop(name), e["time"]))
    lives = []
    for name in spawns:
        records = read_records(log_dir / f"{name}.jsonl")
        lives += split_lives(name, records, spawns[name], deaths[name], end, frozen.get(name, []))
    return lives


def report_from_logs(log_dir: Path, planned_peers: int) -> dict:
    events = read_jsonl(log_dir / "chaos-events.jsonl")
    start = next(e["time"] for e in events if e["event"] == "begin")
    end = next((e["time"] for e in events if e["event"] == "end"), time.time())
    kills = [e for e in events if e["event"] == "kill"]
    slots = {e["peer"] for e in events if e["event"] == "spawn"}
    return dict(
        seconds=round(end - start, 1), slots=len(slots),
        kills=len(kills), kills_by_phase={p: sum(e["phase"] == p for e in kills) for p in PHASES},
        kills_by_target={t: sum(e.get("target", "peer") == t for e in kills) for t in KILL_TARGETS},
        freezes=sum(e["event"] == "freeze" for e in events),
        restarts=sum(e["event"] == "spawn" for e in events) - len(slots),
        exits=sum(e["event"] == "exit" for e in events),
        newcomers=len(slots) - planned_peers,
        **summarize(lives_from_logs(log_dir), start, end, STEP_WINDOW),
        **kill_losses(log_dir, kills),
    )


def kill_losses(log_dir: Path, kills: list[dict]) -> dict:
    """What each SIGKILL cost its peer's training: the seconds from the newest checkpoint it had written (in that
    life; none: from its spawn) to the kill. An upper bound on the inner-step time lost: the restart resumes from
    that checkpoint (or gives its unsettled steps up: `DiLoCo.unsettled`, logged)."""
    events = read_jsonl(log_dir / "chaos-events.jsonl")
    losses = []
    for kill in kills:
        name, at = kill["peer"], kill["time"]
        spawned = max(e["time"] for e in events if e["event"] == "spawn" and e.get("peer") == name and e["time"] < at)
        saved = [r.time for r in read_records(log_dir / f"{name}.jsonl")
                 if r.kind == "checkpoint" and spawned <= r.time < at]
        losses.append(at - max(saved, default=spawned))
    return dict(loss_per_kill_seconds_max=round(max(losses), 1) if losses else None,
                loss_per_kill_seconds_median=round(sorted(losses)[len(losses) // 2], 1) if losses else None)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _tail_records(path: Path, size: int = 1 << 15) -> list[Record]:
    """The records in the last `size` bytes of a JSONL file (cheap enough to poll several times a second)."""
    if not path.exists():
        return []
    with path.open("rb") as f:
        offset = max(0, path.stat().st_size - size)
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    return parse_records(lines[1:] if offset else lines)  # from mid-file, the first line is cut
