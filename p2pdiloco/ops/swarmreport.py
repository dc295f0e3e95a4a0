"""What a swarm run achieved, computed from its peers' JSONL records alone (no processes, no network).

Used by the chaos tool, the benchmarks and the tests. A slot is one peer name; it may have several lives
(processes), e.g. killed and restarted. A life's records are those written between its spawn and the next.

- goodput: inner-step time whose progress reached the global model, over allocated peer time (every slot
  from its first spawn to the end of the run, including the time it lay dead or frozen, and joining);
- uptime: fraction of fixed windows in which the global model advanced (a new highest version);
- stalls: the longest time a live, unfrozen peer spent without an inner step, and without a merged round;
- agreement: islands whose members ended one round with different states (a mixed or partial round: must
  never happen), and forks (two islands merging apart from one version) that are not resolved in time.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from p2pdiloco.runtime.schema import Record, Round, Window

Interval = tuple[float, float]


@dataclass
class Life:
    slot: str
    spawned: float
    ended: float  # killed, exited, or the end of the run
    records: list[Record]
    frozen: list[Interval] = field(default_factory=list)

    def of_kind(self, kind: str) -> list:
        return [r for r in self.records if r.kind == kind]

    def cumulative(self, name: str) -> float:
        """The last value of a life-long counter (compute_seconds, merged_seconds) that windows and rounds carry."""
        last = next((r for r in reversed(self.records) if isinstance(r, (Window, Round))), None)
        return getattr(last, name) if last is not None else 0.0

    @property
    def training_from(self) -> Optional[float]:
        start = self.of_kind("start")
        return start[0].time if start else None


def split_lives(slot: str, records: list[Record], spawns: list[float], deaths: list[Optional[float]], end: float,
                frozen: Iterable[Interval] = ()) -> list[Life]:
    """Cut one slot's records into lives at its spawn times; `deaths[i]` is when life i was killed (None: it
    ran until it exited or the run ended)."""
    lives, frozen = [], list(frozen)
    for i, spawned in enumerate(spawns):
        until = spawns[i + 1] if i + 1 < len(spawns) else float("inf")
        mine = [r for r in records if spawned <= r.time < until]
        exited = max((r.time for r in mine if r.kind == "summary"), default=None)
        ended = min(x for x in (deaths[i], exited, until, end) if x is not None)
        lives.append(Life(slot, spawned, ended, mine, [f for f in frozen if spawned <= f[0] < ended]))
    return lives


def _overlap(a: Interval, intervals: Iterable[Interval]) -> float:
    return sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for b in intervals)


def goodput(lives: list[Life], start: float, end: float) -> dict:
    first_spawn: dict[str, float] = {}
    for life in lives:
        first_spawn[life.slot] = min(first_spawn.get(life.slot, life.spawned), life.spawned)
    allocated = sum(end - max(t, start) for t in first_spawn.values())
    alive = sum(life.ended - life.spawned - _overlap((life.spawned, life.ended), life.frozen) for life in lives)
    merged = sum(life.cumulative("merged_seconds") for life in lives)
    compute = sum(life.cumulative("compute_seconds") for life in lives)
    joining = sum(min(life.training_from or life.ended, life.ended) - life.spawned for life in lives)
    frozen = sum(_overlap((life.spawned, life.ended), life.frozen) for life in lives)
    return dict(goodput=merged / max(allocated, 1e-9), goodput_of_alive_time=merged / max(alive, 1e-9),
                utilization=compute / max(alive, 1e-9), merged_seconds=merged, compute_seconds=compute,
                allocated_seconds=allocated, alive_seconds=alive,
                # where allocated time went that did not reach Θ (shares of allocated time)
                lost_unmerged_compute=(compute - merged) / max(allocated, 1e-9),
                lost_joining=joining / max(allocated, 1e-9), lost_frozen=frozen / max(allocated, 1e-9),
                lost_dead=(allocated - alive - frozen) / max(allocated, 1e-9),
                lost_other=(alive - joining - compute) / max(allocated, 1e-9))


def model_tokens(rounds: list[Round]) -> int:
    """The tokens merged into the most advanced Θ any peer applied: the work that reached the model, whatever time
    it took (on a shared machine a dead peer's cores go to the live ones, which goodput's seconds do not see)."""
    return max((r.swarm_tokens or 0 for r in rounds if r.applied), default=0)


def advances(lives: list[Life]) -> list[float]:
    """Times at which the global model reached a new highest version (any peer's merged round)."""
    rounds = sorted((r.time, r.version) for life in lives for r in life.of_kind("round") if r.applied)
    times, best = [], -1
    for t, version in rounds:
        if version > best:
            times.append(t)
            best = version
    return times


def uptime(advance_times: list[float], start: float, end: float, window: float) -> float:
    """Fraction of `window`-long slices of [start, end) in which the global model advanced at least once."""
    n = max(1, int((end - start) // window))
    hit = {int((t - start) // window) for t in advance_times if start <= t < start + n * window}
    return len(hit) / n


def longest_stalls(lives: list[Life], step_window: int) -> dict:
    """Per life, after it began training: the longest time without an inner step (the gap between two
    `window` records beyond the `step_window` steps they cover), and the longest time without a merged
    round; time frozen by SIGSTOP does not count (a frozen peer is not a live one)."""
    no_step, no_merge = 0.0, 0.0
    for life in lives:
        begin = life.training_from
        if begin is None:
            continue
        windows = life.of_kind("window")
        marks = [begin] + [w.time for w in windows]
        for i in range(1, len(marks)):
            gap = marks[i] - marks[i - 1] - _overlap((marks[i - 1], marks[i]), life.frozen)
            no_step = max(no_step, gap - step_window * windows[i - 1].step_seconds)
        merges = [begin] + [r.time for r in life.of_kind("round") if r.applied] + [life.ended]
        for a, b in zip(merges, merges[1:]):
            no_merge = max(no_merge, b - a - _overlap((a, b), life.frozen))
    return dict(longest_stall_seconds=max(no_step, 0.0), longest_without_merge_seconds=no_merge)


def islands_disagreeing(round_records: Iterable[Round]) -> dict[str, set[tuple[int, str]]]:
    """Islands whose members ended a merged round with different states: a mixed or partial round.

    Two islands that merged apart from one version may legitimately hold different states at one version (a
    fork, resolved later); members of one island never may. A member that adopted a newer state in the same
    round (a stale contributor) is left out: it holds the island's result or something newer."""
    by_island: dict[str, set[tuple[int, str]]] = {}
    for r in round_records:
        if r.applied and r.group_id and not r.adopted:
            by_island.setdefault(r.group_id, set()).add((r.version, r.digest))
    return {group: states for group, states in by_island.items() if len(states) > 1}


def unresolved_forks(rounds_by_peer: dict[str, list[Round]], within_rounds: int, from_version: int = 0,
                     live: Optional[Callable[[str, float], bool]] = None) -> list[tuple[str, int]]:
    """(peer, round) where a peer saw live peers disagree at one version (fork_distance > 0) and still saw a
    disagreement in each of its next `within_rounds` rounds (rounds near the end of a log are not judged,
    nor rounds that ended below `from_version`). `live(name, time)`: whether a peer was running then; a round
    whose fork was only with peers that were not (a killed or frozen peer's record stays until it expires) shows
    no fork of live peers."""
    def forked(r: Round) -> bool:
        if r.fork_distance <= 0:
            return False
        return live is None or not r.forked_with or any(live(name, r.time) for name in r.forked_with)

    stuck = []
    for name, rounds in rounds_by_peer.items():
        for i, r in enumerate(rounds[:len(rounds) - within_rounds]):
            later = rounds[i + 1:i + 1 + within_rounds]
            if r.version >= from_version and forked(r) and all(forked(x) for x in later):
                stuck.append((name, r.round))
    return stuck


def running(lives: list[Life]) -> Callable[[str, float], bool]:
    """live(slot, time) for `unresolved_forks`: a life of that slot had been spawned and had not ended, and was
    not frozen then."""
    def live(slot: str, t: float) -> bool:
        return any(life.slot == slot and life.spawned <= t <= life.ended
                   and not any(a <= t <= b for a, b in life.frozen) for life in lives)
    return live


def stale_merges(records: Iterable[Iterable[Record]]) -> list[dict]:
    """The swarm's merged rounds with a member behind the newest, as each member logged them (version, how far
    behind each member was, the weights' total)."""
    seen = {}
    for rec in records:
        for r in rec:
            if r.kind == "round" and r.applied and len(set(r.member_versions)) > 1:
                newest = max(r.member_versions)
                seen[(r.version, r.digest)] = dict(version=r.version, behind=[newest - v for v in r.member_versions],
                                                   weights_total=round(sum(r.weights), 4))
    return sorted(seen.values(), key=lambda x: x["version"])


def val_by_version(records: Iterable[Iterable[Record]]) -> dict[int, float]:
    """The global model's validation loss at each version it was evaluated at, as the swarm's peers logged it
    (where a version was forked, the lowest of its states' losses)."""
    val: dict[int, float] = {}
    for rec in records:
        for r in rec:
            if r.kind == "round" and r.applied and r.val_loss is not None:
                val[r.version] = min(r.val_loss, val.get(r.version, r.val_loss))
    return dict(sorted(val.items()))


def val_rises(val: dict[int, float], noise: float = 0.0) -> list[tuple[int, float, float]]:
    """(version, loss before, loss after) wherever a round raised the global model's validation loss by more than
    `noise`, compared with the last version evaluated before it."""
    versions = sorted(val)
    return [(b, val[a], val[b]) for a, b in zip(versions, versions[1:]) if val[b] > val[a] + noise]


def forks(records: Iterable[Iterable[Record]]) -> dict[int, int]:
    """Versions at which the swarm's peers made more than one global state: version → how many."""
    states: dict[int, set] = {}
    for rec in records:
        for r in rec:
            if r.kind == "round" and r.applied:
                states.setdefault(r.version, set()).add(r.digest)
    return {v: len(d) for v, d in sorted(states.items()) if len(d) > 1}


def island_waits(records: Iterable[Iterable[Record]]) -> dict[str, int]:
    """Rounds that waited for an island merging without them (--wait-for-island), by how each ended."""
    ended: dict[str, int] = {}
    for rec in records:
        for r in rec:
            if r.kind == "round" and r.waited_for_island:
                ended[r.outcome] = ended.get(r.outcome, 0) + 1
    return ended


def startup_phases(lives: list[Life]) -> dict:
    """Where a restart's seconds went before its first step (the `start` record's phases), median over the
    lives that resumed from a checkpoint of their own: imports, workload, helpers, model, checkpoint, join."""
    restarts = [life.of_kind("start")[0].startup for life in lives if life.of_kind("restore") and life.of_kind("start")]
    restarts = [phases for phases in restarts if phases]
    names = dict.fromkeys(name for phases in restarts for name in phases)  # in the order they came
    return dict(restart_phases_median={n: round(statistics.median(p.get(n, 0.0) for p in restarts), 2)
                                       for n in names},
                restart_seconds_median=round(statistics.median(sum(p.values()) for p in restarts), 2)
                if restarts else None)


def summarize(lives: list[Life], start: float, end: float, step_window: int) -> dict:
    rounds = [r for life in lives for r in life.of_kind("round")]
    times = advances(lives)
    gaps = [b - a for a, b in zip(times, times[1:])]
    window = 2 * statistics.median(gaps) if gaps else end - start
    at_end = [life for life in lives if life.ended >= end - 1e-6]
    finals = [life.of_kind("summary")[-1].final_val for life in at_end if life.of_kind("summary")]
    joins = [life.training_from - life.spawned for life in lives if life.training_from is not None]
    last_rounds = [life.of_kind("round")[-1] for life in at_end if life.of_kind("round")]
    return dict(
        **goodput(lives, start, end),
        uptime=uptime(times, start, end, window), uptime_window_seconds=window,
        versions=max((r.version for r in rounds), default=0),
        model_tokens=model_tokens(rounds),
        **longest_stalls(lives, step_window),
        join_seconds_max=max(joins, default=0.0),
        join_seconds_median=statistics.median(joins) if joins else 0.0,
        **startup_phases(lives),
        rounds=len(rounds), rounds_merged=sum(r.applied for r in rounds),
        rounds_with_fork=sum(r.fork_distance > 0 for r in rounds),
        max_fork_distance=max((r.fork_distance for r in rounds), default=0.0),
        final_fork_distance=max((r.fork_distance for r in last_rounds), default=0.0),
        split_islands=len(islands_disagreeing(rounds)),
        final_val=[round(v, 4) for v in finals],
        final_val_median=statistics.median(finals) if finals else None,
        lives=len(lives),
    )


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m p2pdiloco.ops.swarmreport --falling LOG_DIR`: exit 1, saying where, if a round raised the merged
    model's validation loss (the demo's check)."""
    import argparse
    from pathlib import Path

    from p2pdiloco.runtime.schema import read_records

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--falling", type=Path, required=True, metavar="LOG_DIR")
    args = parser.parse_args(argv)
    val = val_by_version(read_records(path) for path in sorted(args.falling.glob("*.jsonl")))
    rises = val_rises(val)
    if not val:
        print(f"{args.falling}: no evaluated round", file=sys.stderr)
        return 1
    for version, before, after in rises:
        print(f"round to v{version} raised the merged model's validation loss: {before:.4f} -> {after:.4f}",
              file=sys.stderr)
    return 1 if rises else 0


if __name__ == "__main__":
    sys.exit(main())
