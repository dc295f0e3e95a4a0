"""The one parser of what remote peers send us: DHT peer records and the member records gathered for a round.

Nothing from the network is trusted. Every field is checked for type, range, size and finiteness here, and
nowhere else; a malformed value yields None (with the reason, for members), never an exception. Hostile-update
defences extend this module: a member that fails a check is excluded from the merge with its reason.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from p2pdiloco.core.consensus import SKETCH_DIM
from p2pdiloco.core.exact import n_blocks
from p2pdiloco.core.state import lineage_rank

MAX_ID = 128  # peer ids are ~52 characters of base58
MAX_NAME = 64
MAX_DIGEST = 64
MIN_DIGEST = 6
MAX_VERSION = 1 << 53  # versions, steps and tokens stay exact as JSON numbers and floats
MAX_NORMS = 1 << 16  # one RDA norm per tensor
MAX_ISLAND = 1 << 16
MAX_BLAME = 64  # peers one member may blame at once
# The version of everything a peer puts on the wire or in the DHT: the codec's parts and sums, gathered member
# records and peer records, pinned byte for byte by tests/golden/v<N>/. A change to any of them adds a folder
# there and raises this number. Peers publish it in their records; a record of another version is not parsed
# (its fields may mean other things), only counted, so a joiner can say which versions it met
# (p2pdiloco.protocol.compat.wire_mismatch), and islands of two versions never form (the averager's prefix).
# Version 0: peers from before versions were published. 2: peer records say how many devices (ranks) the member
# trains on. 3: records are signed by the peer's libp2p key (p2pdiloco.swarm.signing), which an older peer cannot
# read. 4: a reducer serves its account of each part after the part's sums (p2pdiloco.core.audit), which a
# member of version 3 would take for a piece too many. 5: records say how many members merged the state
# (`merged_by`), and forks at one version reconcile to the state of the larger island (p2pdiloco.core.state); a peer
# of P fragments publishes one record, fragment 0's fields its own and the others' in `lanes`. 6: a record's sketches
# are fp32 bytes, not lists of float64 numbers (579 bytes each in msgpack, against 258), and a lane leaves out its
# fields at their defaults: a peer of 8 fragments published 6.2 KB, fetched from every replica at every poll of a
# round (docs/fragments.md).
WIRE_VERSION = 6


@dataclass
class PeerRecord:
    """What a peer publishes on the DHT about itself between rounds."""

    peer: str
    name: str
    version: int  # outer steps applied to this peer's global state
    digest: str  # hash of its global parameters: equal digests at equal versions = consensus
    ready: int = -1  # the version it contributes from while it looks for an island, or -1
    merging: int = -1  # the version it contributes from while its island's all-reduce runs (closed to others), or -1
    inner_step: int = 0
    tokens_per_s: float = 0.0
    sketch: list = field(default_factory=list)  # p2pdiloco.core.consensus.sketch of its Θ
    # for people watching the swarm (p2pdiloco status); no round decision reads them
    loss: float = 0.0  # mean training loss of its last window of inner steps
    rounds: int = 0  # rounds it has settled (merged or not)
    island: int = 0  # members of its last round's island (1: alone)
    bytes_sent: int = 0  # by its averager, over all its rounds
    client_mode: bool = False  # reachable only through others (cannot accept connections)
    devices: int = 1  # the ranks (GPUs, or CPU processes) it trains on as one member (torchrun)
    settings: dict = field(default_factory=dict)  # what must match to merge (p2pdiloco.protocol.compat)
    wire: int = WIRE_VERSION
    merged_by: int = 0  # members of the merge that made its state (0: none did): forks reconcile by it
    # a peer of P fragments: fragments 1..P-1's own fields (LANE_FIELDS), fragment 0's being the record's; one record
    # and one heartbeat for all of them, not P (each a store and a fetch of ~40 KB every beat: docs/fragments.md)
    lanes: list = field(default_factory=list)

    @property
    def key(self) -> tuple[int, str]:
        return (self.version, self.digest)

    @property
    def rank(self) -> tuple[int, int, str]:
        return lineage_rank(self.version, self.merged_by, self.digest)

    def value(self) -> dict:
        """What goes into the DHT for this record (`parse_peer_record` reads it back): the sketches as fp32 bytes, and
        each lane without its fields at their defaults."""
        value = dataclasses.asdict(self)
        value["sketch"] = pack_sketch(self.sketch)
        value["lanes"] = [{k: (pack_sketch(v) if k == "sketch" else v) for k, v in lane.items()
                           if k not in LANE_DEFAULTS or v != LANE_DEFAULTS[k]} for lane in self.lanes]
        return value

    def lane(self, i: int) -> Optional["PeerRecord"]:
        """Fragment i's record, as a swarm of that fragment alone sees it (None: this peer has no fragment i)."""
        if i == 0:
            return dataclasses.replace(self, lanes=[])
        if not 0 < i <= len(self.lanes):
            return None
        return dataclasses.replace(self, lanes=[], **{**LANE_DEFAULTS, **self.lanes[i - 1]})


def pack_sketch(values: Sequence[float]) -> bytes:
    """A sketch on the wire: fp32, little-endian. Its estimate of a distance is good to tens of percent
    (core.consensus), so fp32's 1e-7 costs nothing, and a float64 list is twice the bytes."""
    return struct.pack(f"<{len(values)}f", *values)


LANE_FIELDS = ("version", "digest", "merged_by", "ready", "merging", "sketch", "rounds", "island", "bytes_sent")
# what a fragment's record says where its lane leaves a field out: never fragment 0's value
LANE_DEFAULTS = dict(merged_by=0, ready=-1, merging=-1, sketch=[], rounds=0, island=0, bytes_sent=0)
MAX_LANES = 255


@dataclass(frozen=True)
class Member:
    """One island member's record for a round, as gathered during matchmaking, once validated."""

    peer: str
    name: str
    version: int  # the global version its pseudo-gradient was taken from
    digest: str
    tokens: int  # tokens it trained since its last merged contribution
    steps: int
    budget: float  # the all-reduce deadline it asks for (from its measured link)
    norms: tuple[float, ...] = ()  # RDA: one norm per tensor segment
    maxabs: bytes = b""  # fp32 block maxima of its pseudo-gradient (p2pdiloco.core.exact)
    block_norms: bytes = b""  # fp32 block L2 norms of it (p2pdiloco.core.claims): its codes may not exceed them
    blame: frozenset = frozenset()  # peers whose part or sum failed it in a recent round
    credential: bytes = b""  # its swarm pass (p2pdiloco.swarm.auth), where the swarm has a key

    @property
    def key(self) -> tuple[int, str]:
        return (self.version, self.digest)

    @property
    def delta_norm(self) -> Optional[float]:
        """The L2 norm of its pseudo-gradient, from the block norms it claims (None where it sent none). Every
        member bounds the merge with it, so its arithmetic must not change between releases: one ulp apart, two
        versions of p2pdiloco would weigh a member differently and fork."""
        if not self.block_norms:
            return None
        return float(torch.frombuffer(bytearray(self.block_norms), dtype=torch.float32).double().square().sum().sqrt())

    def as_record(self) -> dict:
        """For metrics and logs: everything but the block maxima."""
        return dict(peer=self.peer, name=self.name, version=self.version, digest=self.digest, tokens=self.tokens,
                    steps=self.steps)


class Malformed(ValueError):
    """A remote value failed validation; the message names the field and what was wrong."""


def _str(value: Any, name: str, lo: int, hi: int) -> str:
    if not isinstance(value, str) or not lo <= len(value) <= hi:
        raise Malformed(f"{name} must be a string of {lo}..{hi} characters")
    return value


def _int(value: Any, name: str, lo: int = 0, hi: int = MAX_VERSION) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise Malformed(f"{name} must be an integer in [{lo}, {hi}], got {_short(value)}")
    return value


def _float(value: Any, name: str, lo: float = 0.0, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise Malformed(f"{name} must be a finite number in [{lo}, {hi}], got {_short(value)}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise Malformed(f"{name} must be true or false, got {_short(value)}")
    return value


def _floats(value: Any, name: str, max_len: int, lo: float = -math.inf) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > max_len:
        raise Malformed(f"{name} must be a list of at most {max_len} numbers")
    return tuple(_float(x, name, lo=lo) for x in value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fields(value: Any, known: Sequence[str], required: Sequence[str]) -> dict:
    if not isinstance(value, dict):
        raise Malformed(f"expected a record (dict), got {type(value).__name__}")
    unknown = set(value) - set(known)
    if unknown:
        raise Malformed(f"unknown fields {sorted(map(str, unknown))[:4]}")
    missing = [k for k in required if k not in value]
    if missing:
        raise Malformed(f"missing fields {missing}")
    return value


_PEER_FIELDS = ("peer", "name", "version", "digest", "merged_by", "ready", "merging", "inner_step", "tokens_per_s",
                "sketch", "loss", "rounds", "island", "bytes_sent", "client_mode", "devices", "settings", "wire",
                "lanes")
MAX_DEVICES = 1 << 16
MAX_SETTINGS = 32


def parse_peer_record(value: Any) -> Optional[PeerRecord]:
    """A DHT peer record, or None if anything in it is malformed."""
    try:
        return _peer_record(value)
    except Malformed:
        return None


def record_wire(value: Any) -> int:
    """The wire version a DHT record announces: first, since every other field may differ between versions."""
    if not isinstance(value, dict):
        return WIRE_VERSION  # not a record at all: malformed, not another version
    wire = value.get("wire", 0)
    return wire if isinstance(wire, int) and not isinstance(wire, bool) and 0 <= wire < 1 << 16 else -1


def _peer_record(value: Any) -> PeerRecord:
    wire = record_wire(value)
    if wire != WIRE_VERSION:  # counted apart (record_wire), never parsed
        raise Malformed(f"wire version {wire}, not this peer's {WIRE_VERSION}")
    v = _fields(value, _PEER_FIELDS, ("peer", "name", "version", "digest", "wire"))
    return PeerRecord(peer=_str(v["peer"], "peer", 1, MAX_ID), name=_str(v["name"], "name", 0, MAX_NAME),
                      **_lane_fields(v),  # fragment 0's, or the whole model's
                      inner_step=_int(v.get("inner_step", 0), "inner_step"),
                      tokens_per_s=_float(v.get("tokens_per_s", 0.0), "tokens_per_s"),
                      loss=_float(v.get("loss", 0.0), "loss"),
                      client_mode=_bool(v.get("client_mode", False), "client_mode"),
                      devices=_int(v.get("devices", 1), "devices", lo=1, hi=MAX_DEVICES),
                      settings=_settings(v.get("settings", {})), lanes=_lanes(v.get("lanes", [])))


def _lanes(value: Any) -> list[dict]:
    if not isinstance(value, list) or len(value) > MAX_LANES:
        raise Malformed(f"lanes must be a list of at most {MAX_LANES}")
    return [_lane_fields(_fields(lane, LANE_FIELDS, ("version", "digest"))) for lane in value]


def _lane_fields(v: dict) -> dict:
    """The fields a record holds for each fragment (LANE_FIELDS), validated."""
    return dict(version=_int(v["version"], "version"), digest=_str(v["digest"], "digest", MIN_DIGEST, MAX_DIGEST),
                merged_by=_int(v.get("merged_by", 0), "merged_by", hi=MAX_ISLAND),
                ready=_int(v.get("ready", -1), "ready", lo=-1), merging=_int(v.get("merging", -1), "merging", lo=-1),
                sketch=_sketch(v.get("sketch", b"")),
                rounds=_int(v.get("rounds", 0), "rounds"), island=_int(v.get("island", 0), "island", hi=MAX_ISLAND),
                bytes_sent=_int(v.get("bytes_sent", 0), "bytes_sent"))


def _sketch(value: Any) -> list[float]:
    if not isinstance(value, bytes) or len(value) % 4 or len(value) > 4 * SKETCH_DIM:
        raise Malformed(f"sketch must be at most {SKETCH_DIM} fp32 values, as bytes")
    values = struct.unpack(f"<{len(value) // 4}f", value)
    if not all(math.isfinite(x) for x in values):
        raise Malformed("sketch holds a non-finite value")
    return list(values)


def _settings(value: Any) -> dict:
    if not isinstance(value, dict) or len(value) > MAX_SETTINGS:
        raise Malformed(f"settings must be a dict of at most {MAX_SETTINGS} entries")
    return {_str(k, "settings key", 1, 32): _str(v, "settings value", 0, 64) for k, v in value.items()}


_MEMBER_FIELDS = ("peer", "name", "version", "digest", "tokens", "steps", "budget", "norms", "maxabs",
                  "block_norms")
_OPTIONAL_MEMBER_FIELDS = ("blame", "pass")
MAX_PASS = 64


@dataclass(frozen=True)
class Expect:
    """What a well-formed member record must match in this swarm: the sizes follow from the model."""

    n_params: int
    n_norms: int = 0  # RDA segments; 0: no norms expected


def parse_member(value: Any, expect: Expect) -> Member:
    """A gathered member record; raises Malformed with the reason."""
    v = _fields(value, _MEMBER_FIELDS + _OPTIONAL_MEMBER_FIELDS, _MEMBER_FIELDS)
    blame, credential = _blame_and_pass(v)
    tokens, steps = _int(v["tokens"], "tokens"), _int(v["steps"], "steps")
    if tokens and not steps:
        raise Malformed("tokens without steps")
    norms = _floats(v["norms"], "norms", MAX_NORMS, lo=0.0)
    if len(norms) != expect.n_norms:
        raise Malformed(f"norms: expected {expect.n_norms}, got {len(norms)}")
    maxabs, block_norms = _block_statistic(v, "maxabs", expect), _block_statistic(v, "block_norms", expect)
    return Member(peer=_str(v["peer"], "peer", 1, MAX_ID), name=_str(v["name"], "name", 0, MAX_NAME),
                  version=_int(v["version"], "version"), digest=_str(v["digest"], "digest", MIN_DIGEST, MAX_DIGEST),
                  tokens=tokens, steps=steps, budget=_budget(v["budget"]), norms=norms, maxabs=maxabs,
                  block_norms=block_norms, blame=blame, credential=credential)


def _blame_and_pass(v: dict) -> tuple[frozenset, bytes]:
    """A gathered record's optional blame list and swarm pass."""
    blame = v.get("blame", [])
    if not isinstance(blame, (list, tuple)) or len(blame) > MAX_BLAME:
        raise Malformed(f"blame must be a list of at most {MAX_BLAME} peer ids")
    credential = v.get("pass", b"")
    if not isinstance(credential, bytes) or len(credential) > MAX_PASS:
        raise Malformed(f"pass must be at most {MAX_PASS} bytes")
    return frozenset(_str(p, "blame", 1, MAX_ID) for p in blame), credential


def _block_statistic(v: dict, name: str, expect: Expect) -> bytes:
    """fp32 per block, finite and non-negative: a NaN or negative one would poison the group's scales or bounds."""
    value = v[name]
    if not isinstance(value, bytes) or len(value) != 4 * n_blocks(expect.n_params):
        raise Malformed(f"{name} must be {4 * n_blocks(expect.n_params)} bytes (fp32 per block)")
    if not _finite_non_negative(value):
        raise Malformed(f"{name} holds a non-finite or negative value")
    return value


def _finite_non_negative(fp32: bytes) -> bool:
    values = torch.frombuffer(bytearray(fp32), dtype=torch.float32)
    return bool(torch.isfinite(values).all()) and bool((values >= 0).all())


def _budget(value: Any) -> float:
    """A hostile budget can neither hang nor cut short a round: out of range means 'as patient as allowed'."""
    try:
        return _float(value, "budget", lo=1e-3)
    except Malformed:
        return math.inf


_NODE_FIELDS = ("peer", "name", "budget")  # and, as a member's, "blame" and "pass"


@dataclass(frozen=True)
class ReducerNode:
    """A group member that only reduces parts (`p2pdiloco bootstrap --reduce`): public, with no model, it
    contributes nothing and sums the codes of a part for members that nobody can dial."""

    peer: str
    name: str
    blame: frozenset = frozenset()
    credential: bytes = b""


def parse_reducer_node(value: Any) -> ReducerNode:
    """A reducer node's gathered record; raises Malformed with the reason. Its budget is read and not used: the
    round's deadline is the contributors' to agree."""
    v = _fields(value, _NODE_FIELDS + _OPTIONAL_MEMBER_FIELDS, _NODE_FIELDS)
    blame, credential = _blame_and_pass(v)
    _budget(v["budget"])
    return ReducerNode(peer=_str(v["peer"], "peer", 1, MAX_ID), name=_str(v["name"], "name", 0, MAX_NAME),
                       blame=blame, credential=credential)


@dataclass(frozen=True)
class Island:
    """The gathered records of one round's group, parsed. `members[i]` is None where record i was malformed
    (its reason in `rejected[i]`); such a member is excluded from the merge (weight 0). It is None too where
    member i is a reducer node (`nodes[i]`), which contributes nothing."""

    members: tuple[Optional[Member], ...]
    rejected: tuple[str, ...]  # "" for accepted members and reducer nodes
    nodes: dict = field(default_factory=dict)  # group index → ReducerNode, for the well-formed reducer nodes

    @property
    def accepted(self) -> list[Member]:
        return [m for m in self.members if m is not None]

    def excluded_by_index(self) -> dict[str, str]:
        """Member position → reason, for the members that were rejected (their ids cannot be trusted)."""
        return {str(i): why for i, why in enumerate(self.rejected) if why}


def parse_island(values: Sequence[Any], expect: Expect, peer_ids: Optional[Sequence[str]] = None,
                 admit: Optional[Callable[[str, bytes], bool]] = None, nodes: frozenset = frozenset()) -> Island:
    """`peer_ids`: the ids libp2p authenticated, in the group's order; a record must name its sender's. `admit`:
    whether a sender's pass shows it holds the swarm's key (a swarm with a key only). `nodes`: the indices of the
    members that said they only reduce (hivemind's auxiliary mode): their records are a reducer node's."""
    members, rejected, parsed_nodes = [], [], {}
    for i, value in enumerate(values):
        try:
            member = parse_reducer_node(value) if i in nodes else parse_member(value, expect)
            if peer_ids is not None and member.peer != peer_ids[i]:
                raise Malformed(f"its record claims another peer's id ({_short(member.peer)})")
            if admit is not None and not admit(member.peer, member.credential):
                raise Malformed("no valid pass: it does not hold this swarm's key")
            if i in nodes:
                parsed_nodes[i] = member
            members.append(None if i in nodes else member)
            rejected.append("")
        except Malformed as e:
            members.append(None)
            rejected.append(str(e))
    return Island(tuple(members), tuple(rejected), parsed_nodes)
