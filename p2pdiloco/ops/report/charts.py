"""From the peers' JSONL to what a report shows: charts (series of points) and a summary table.

Pure data: no plotting library here, so the PNG and the HTML renderers draw the same charts from one place.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from p2pdiloco.runtime.schema import Record, Round, Start, Summary, Window, of_kind, read_records

NOT_PEER_LOGS = {"chaos-events.jsonl"}


class ReportError(ValueError):
    """The run folders hold nothing a report can be made of; the message says what was looked for."""


@dataclass
class PeerLog:
    run: str  # the run folder's name
    peer: str
    records: list[Record]
    run_start: float = 0.0  # the run's first record: wall-clock axes start there

    def of(self, cls: type) -> list:
        return of_kind(self.records, cls)

    def since_start(self, record: Record) -> float:
        return record.time - self.run_start

    def merged_seconds(self) -> Iterable[tuple[Round, float]]:
        """Each round with the inner-step time of this peer that had reached the global model by then, over all
        its processes: a counter that restarts with each process (each writes one Start) is carried over."""
        banked = current = 0.0
        for r in self.records:
            if isinstance(r, Start):
                banked, current = banked + current, 0.0
            elif isinstance(r, (Window, Round)):
                current = r.merged_seconds
                if isinstance(r, Round):
                    yield r, banked + current

    def goodput(self) -> Iterable[tuple[float, float]]:
        """(seconds since the run began, goodput so far): merged inner-step time over the time since this peer
        first appeared, its restarts and the time it lay dead included."""
        first = self.records[0].time
        for r, merged in self.merged_seconds():
            yield self.since_start(r), merged / max(r.time - first, 1e-9)


@dataclass
class Series:
    label: str
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)


@dataclass
class Chart:
    key: str  # file name and HTML id
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    markers_only: bool = False  # one point per round: a scatter reads better than a line

    @property
    def points(self) -> int:
        return sum(len(s.x) for s in self.series)


def load_runs(run_dirs: Iterable[Path]) -> list[PeerLog]:
    """Every peer log (NAME.jsonl) in each run folder; a folder may be a local swarm's, a chaos run's, or
    several machines' logs copied together."""
    peers = []
    for run_dir in map(Path, run_dirs):
        if not run_dir.is_dir():
            raise ReportError(f"{run_dir}: no such folder (give the --log-dir of a run)")
        logs = [PeerLog(run_dir.name, path.stem, read_records(path))
                for path in sorted(run_dir.glob("*.jsonl")) if path.name not in NOT_PEER_LOGS]
        logs = [p for p in logs if p.of(Start) or p.of(Window)]
        if not logs:
            raise ReportError(f"{run_dir}: no peer metrics (NAME.jsonl with training records) in it")
        start = min(p.records[0].time for p in logs)
        for p in logs:
            p.run_start = start
        peers += logs
    return peers


def _label(peer: PeerLog, many_runs: bool) -> str:
    return f"{peer.run}/{peer.peer}" if many_runs else peer.peer


def _series(peers: list[PeerLog], points: Callable[[PeerLog], Iterable[tuple[float, Optional[float]]]]
            ) -> list[Series]:
    many_runs = len({p.run for p in peers}) > 1
    out = []
    for peer in peers:
        s = Series(_label(peer, many_runs))
        for x, y in points(peer):
            if y is not None:
                s.x.append(x)
                s.y.append(y)
        if s.x:
            out.append(s)
    return out


def _val_points(peer: PeerLog, by_tokens: bool):
    """The global model's validation loss: at the start, after evaluated rounds, and on leaving."""
    starts = [s for s in peer.of(Start) if s.val_loss is not None]
    if starts:
        yield (0.0 if by_tokens else peer.since_start(starts[0])), starts[0].val_loss
    for r in peer.of(Round):
        if r.val_loss is not None:
            yield (r.tokens_trained if by_tokens else peer.since_start(r)), r.val_loss
    for s in peer.of(Summary):
        yield (s.tokens if by_tokens else peer.since_start(s)), s.final_val


def charts(peers: list[PeerLog]) -> list[Chart]:
    wall = "wall-clock since the run began (s)"
    tokens = "tokens trained by the peer"
    return [
        Chart("train_loss_time", "Training loss (local model, per window)", wall, "loss",
              _series(peers, lambda p: ((p.since_start(w), w.loss) for w in p.of(Window)))),
        Chart("train_loss_tokens", "Training loss against tokens per peer", tokens, "loss",
              _series(peers, lambda p: ((w.tokens, w.loss) for w in p.of(Window)))),
        Chart("val_loss_time", "Validation loss of the global model", wall, "loss",
              _series(peers, lambda p: _val_points(p, by_tokens=False))),
        Chart("val_loss_tokens", "Validation loss against tokens per peer", tokens, "loss",
              _series(peers, lambda p: _val_points(p, by_tokens=True))),
        Chart("tokens_per_s", "Training throughput", wall, "tokens/s",
              _series(peers, lambda p: ((p.since_start(w), w.tokens_per_s) for w in p.of(Window)))),
        Chart("bytes_per_round", "Bytes on the wire per round (sent + received, measured)", "round", "MB",
              _series(peers, lambda p: ((r.round, _megabytes(r)) for r in p.of(Round))), markers_only=True),
        Chart("island_size", "Island size of each round (1: merged alone or not at all)", wall, "peers",
              _series(peers, lambda p: ((p.since_start(r), r.island) for r in p.of(Round))), markers_only=True),
        Chart("utilization", "Utilization: inner-step time over wall time", wall, "fraction",
              _series(peers, lambda p: ((p.since_start(r), r.utilization) for r in p.of(Round)))),
        Chart("consensus_distance", "Consensus distance: largest distance between live peers' global models",
              wall, "max ‖Θi − Θj‖ (L2, from sketches)",
              _series(peers, lambda p: ((p.since_start(r), r.consensus_distance) for r in p.of(Round)))),
        Chart("goodput", "Goodput: inner-step time that reached the global model, over wall time", wall,
              "fraction", _series(peers, lambda p: p.goodput())),
    ]


def _megabytes(r: Round) -> Optional[float]:
    if r.bytes_sent is None:
        return None
    return (r.bytes_sent + (r.bytes_received or 0)) / 1e6


def summary_rows(peers: list[PeerLog]) -> list[dict]:
    """One row per peer: what its stay achieved (the last process's summary where it left cleanly)."""
    rows = []
    for p in peers:
        rounds, windows, summaries = p.of(Round), p.of(Window), p.of(Summary)
        last = summaries[-1] if summaries else None
        vals = [y for _, y in _val_points(p, by_tokens=False)]
        sent = [r.bytes_sent for r in rounds if r.bytes_sent is not None]
        goodput = list(p.goodput())
        rows.append(dict(
            run=p.run, peer=p.peer, rounds=len(rounds), merged=sum(r.applied for r in rounds),
            version=max((r.version for r in rounds), default=0),
            val_first=vals[0] if vals else None, val_last=vals[-1] if vals else None,
            tokens=last.tokens if last else max((w.tokens for w in windows), default=0),
            tokens_per_s=statistics.fmean(w.tokens_per_s for w in windows) if windows else None,
            mb_sent=sum(sent) / 1e6, utilization=last.utilization if last else None,
            goodput=goodput[-1][1] if goodput else None, left_cleanly=last is not None))
    return rows


COLUMNS = [  # (key, heading, format)
    ("run", "run", "{}"), ("peer", "peer", "{}"), ("rounds", "rounds", "{}"), ("merged", "merged", "{}"),
    ("version", "version", "{}"), ("val_first", "val loss first", "{:.4f}"), ("val_last", "val loss last", "{:.4f}"),
    ("tokens", "tokens", "{:,}"), ("tokens_per_s", "tokens/s", "{:,.0f}"), ("mb_sent", "MB sent", "{:.2f}"),
    ("utilization", "utilization", "{:.1%}"), ("goodput", "goodput", "{:.1%}"), ("left_cleanly", "left cleanly", "{}"),
]


def cell(row: dict, key: str, fmt: str) -> str:
    value = row[key]
    return "-" if value is None else fmt.format(value)
