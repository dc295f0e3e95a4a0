"""The metrics records a peer writes: one typed definition that every writer and reader shares.

A peer's JSONL file holds one record per line, `{"kind": ..., "time": ..., fields}`. Writers build these
classes; readers get them back from `read_records` (the launcher, the report, the chaos tool, the tests), so
no key is typed by hand in two places. Every field has a default: a log written by an older version, or cut
by a kill, still reads, with what it lacks left at None; keys this version does not know are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterable, Optional

KINDS: dict[str, type["Record"]] = {}


def _now() -> float:
    return round(time.time(), 3)


@dataclass(kw_only=True)
class Record:
    KIND: ClassVar[str] = ""
    peer: str = ""  # the peer's name (the label of its log files)
    time: float = field(default_factory=_now)  # Unix time the record was made

    def __init_subclass__(cls, kind: str = "", **kwargs):
        super().__init_subclass__(**kwargs)
        cls.KIND = kind
        KINDS[kind] = cls

    @property
    def kind(self) -> str:
        return self.KIND

    def to_dict(self) -> dict:
        return {"kind": self.KIND, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def numbers(self) -> dict[str, float]:
        """The record's plain numeric fields, for sinks that plot scalars (TensorBoard, W&B)."""
        return {f.name: float(v) for f in dataclasses.fields(self) if f.name != "time"
                for v in [getattr(self, f.name)] if isinstance(v, (int, float)) and not isinstance(v, bool)}

    @property
    def sink_step(self) -> Optional[int]:
        """The x of this record in a step-indexed sink (None: the record has no natural step)."""
        return None


@dataclass(kw_only=True)
class Start(Record, kind="start"):
    """Training begins (after joining, or restoring a checkpoint)."""
    peer_id: Optional[str] = None
    n_params: Optional[int] = None
    val_loss: Optional[float] = None  # of the global model, None with evaluations off
    val_bpb: Optional[float] = None  # the same in bits per byte of validation text
    version: int = 0
    corpus: Optional[str] = None
    mode: Optional[str] = None
    # seconds from the process's start to this record, by phase (imports, workload, helpers, model, checkpoint,
    # join, evaluation): what a restart costs before its first step
    startup: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Joined(Record, kind="joined"):
    """A warm restart's background connection finished: from now on it contributes."""
    peer_id: Optional[str] = None
    inner_step: int = 0
    unmerged_steps: int = 0
    seconds: float = 0.0


@dataclass(kw_only=True)
class Window(Record, kind="window"):
    """Every few inner steps: the local training's progress. Times are cumulative over the process's life."""
    step: int = 0  # inner steps so far
    tokens: int = 0  # tokens trained so far
    loss: Optional[float] = None  # mean training loss over the window
    tokens_per_s: Optional[float] = None
    step_seconds: float = 0.0  # mean seconds per inner step in the window
    in_flight: bool = False  # a round ran in the background meanwhile
    compute_seconds: float = 0.0  # inner-step time
    merged_seconds: float = 0.0  # the part of it whose progress reached the global model

    @property
    def sink_step(self) -> Optional[int]:
        return self.step


@dataclass(kw_only=True)
class Contribute(Record, kind="contribute"):
    """A pseudo-gradient handed to an outer round."""
    version: int = 0  # the global version it was computed from
    tokens: int = 0
    steps: int = 0


@dataclass(kw_only=True)
class Round(Record, kind="round"):
    """An outer round settled: merged (applied) or not, with who took part and what it cost."""
    fragment: Optional[int] = None  # --fragments: the fragment it merged (its version, digest and round count)
    round: int = 0
    version: int = 0  # the global version after the round
    applied: bool = False
    reason: Optional[str] = None
    outcome: Optional[str] = None
    loss: Optional[float] = None  # mean training loss since the last round
    val_loss: Optional[float] = None  # of the global model, when evaluated
    val_bpb: Optional[float] = None  # the same in bits per byte of validation text
    swarm_tokens: Optional[int] = None  # merged into the global model over its lineage (the lr schedule's clock)
    lr: Optional[float] = None  # the inner learning rate of the last step
    tokens: int = 0  # ours in this round
    tokens_trained: int = 0  # ours so far, this process
    from_version: int = 0
    unmerged_tokens: int = 0
    steps_in_flight: int = 0
    members: list = field(default_factory=list)  # names (or ids) of the island's members
    member_tokens: list = field(default_factory=list)
    member_versions: list = field(default_factory=list)
    member_steps: list = field(default_factory=list)
    member_norms: list = field(default_factory=list)  # the L2 norm of each one's Δ, as it claims it
    excluded: dict = field(default_factory=dict)  # member → why it was not merged
    bounded: dict = field(default_factory=dict)  # member → which of its claims were capped (weight, maxima)
    weights: list = field(default_factory=list)
    tokens_merged: int = 0
    group_id: Optional[str] = None
    round_seconds: Optional[float] = None
    quorum_seconds: Optional[float] = None
    sync_seconds: Optional[float] = None
    sync_ended: Optional[float] = None  # Unix time the all-reduce returned (the record comes later)
    codec_cpu_seconds: Optional[float] = None  # of them, what the codec thread worked (CPU time)
    deadline_seconds: Optional[float] = None
    grace_seconds: Optional[float] = None
    step_seconds_ema: Optional[float] = None
    bytes_sent: Optional[int] = None  # measured at the process during the round
    bytes_received: Optional[int] = None
    allreduce_bytes_model: Optional[int] = None  # what the all-reduce layout says we send
    adopted: bool = False  # we took a newer state from a peer instead of merging
    waited_for_island: bool = False  # for an island that merged from our state without us (not to fork it)
    consensus_distance: float = 0.0
    fork_distance: float = 0.0
    forked_with: list = field(default_factory=list)  # the peers (names) whose record showed our version, another digest
    version_spread: int = 0
    live_peers: int = 0
    recovered_tokens: int = 0
    compute_seconds: float = 0.0
    merged_seconds: float = 0.0
    utilization: Optional[float] = None  # inner-step time over the process's wall time so far
    wall: float = 0.0  # seconds since training began
    digest: Optional[str] = None

    @property
    def island(self) -> int:
        return max(1, len(self.members))

    @property
    def sink_step(self) -> Optional[int]:
        return self.round


@dataclass(kw_only=True)
class Resync(Record, kind="resync"):
    """The global state was downloaded from peers."""
    why: Optional[str] = None
    version: int = 0
    digest: Optional[str] = None


@dataclass(kw_only=True)
class Checkpoint(Record, kind="checkpoint"):
    version: int = 0
    path: Optional[str] = None
    why: Optional[str] = None
    seconds: Optional[float] = None  # the write (on a second thread with --checkpoint-background)
    stall_seconds: Optional[float] = None  # what it cost the training thread: the write inline, or the copy


@dataclass(kw_only=True)
class Restore(Record, kind="restore"):
    version: int = 0
    digest: Optional[str] = None
    path: Optional[str] = None
    inner_step: int = 0


@dataclass(kw_only=True)
class Summary(Record, kind="summary"):
    """The peer left: what its stay achieved."""
    rounds: int = 0
    merged_rounds: int = 0
    version: int = 0
    initial_val: Optional[float] = None
    final_val: Optional[float] = None
    final_val_bpb: Optional[float] = None  # in bits per byte of validation text
    digest: Optional[str] = None
    seconds: float = 0.0  # the whole stay
    training_seconds: float = 0.0
    compute_seconds: float = 0.0
    utilization: float = 0.0
    tokens: int = 0
    device_peak_bytes: Optional[int] = None  # a GPU peer: torch's peak of allocated device memory


def from_dict(data: dict) -> Optional[Record]:
    """A record from its JSON object; None for a kind this version does not know, or a line that is not one."""
    cls = KINDS.get(data.get("kind")) if isinstance(data, dict) else None
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def parse_records(lines: Iterable[str]) -> list[Record]:
    records = []
    for line in lines:
        try:
            record = from_dict(json.loads(line))
        except (json.JSONDecodeError, TypeError):
            continue  # a line cut by a kill
        if record is not None:
            records.append(record)
    return records


def read_records(path: Path) -> list[Record]:
    path = Path(path)
    return parse_records(path.read_text().splitlines()) if path.exists() else []


def of_kind(records: Iterable[Record], cls: type) -> list:
    return [r for r in records if isinstance(r, cls)]
