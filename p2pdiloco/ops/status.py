"""`p2pdiloco status`: the live swarm as its peers publish it on the DHT, seen by a client that trains nothing.

Every training peer keeps a record fresh on the DHT (p2pdiloco.swarm.records, every 2 s, expiring after 6 s); a
status client joins the DHT in client mode (it serves nothing and is never asked to), reads them through the
same validating parser every peer uses, and shows one row per peer plus the swarm's totals. A SIGKILLed peer
stops refreshing its record and drops out once the record expires.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from p2pdiloco.core.consensus import consensus_distance
from p2pdiloco.protocol.remote import PeerRecord


@dataclass(frozen=True)
class PeerView:
    name: str
    peer: str  # the peer id's last 8 characters: enough to tell peers apart
    version: int
    tokens_per_s: float
    loss: Optional[float]  # None until its first window of inner steps
    island: int
    rounds: int
    bytes_sent: int
    client_mode: bool
    devices: int  # ranks training as this one member
    seen_seconds_ago: Optional[float]  # since it last published its record (None: the DHT did not say)
    ready: bool  # looking for an island right now
    merging: bool = False  # its island's all-reduce is running (closed to others)
    versions: tuple = ()  # --fragments: each fragment's version (`version` is then their sum)


@dataclass(frozen=True)
class SwarmView:
    run_id: str
    peers: list[PeerView]
    tokens_per_s: float
    newest_version: int
    version_spread: int
    consensus_distance: float
    rounds_per_minute: Optional[float] = None  # global versions per minute, once two views are compared
    reducers: list = field(default_factory=list)  # the live reducer nodes' names (or ids' last 8 characters)
    fragments: list = field(default_factory=list)  # --fragments: each fragment's swarm (newest version, spread)
    at: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict:
        """For --json: `at` is this client's monotonic clock, meaningless to anyone else."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "at"} | {"n_peers": len(self.peers)}


def view_of(run_id: str, seen: list[tuple[PeerRecord, Optional[float]]], before: Optional[SwarmView] = None,
            reducers: Sequence[dict] = ()) -> SwarmView:
    """The swarm from its peers' records (with the seconds since each was published) and its reducer nodes'
    announcements; `before`, an earlier view, gives the rate of global versions."""
    records = [r for r, _ in seen]
    peers = sorted((_peer_view(r, age) for r, age in seen), key=lambda p: (p.name, p.peer))
    versions = [r.version for r in records]
    newest = max(versions, default=0)
    view = SwarmView(run_id=run_id, peers=peers, tokens_per_s=sum(p.tokens_per_s for p in peers),
                     newest_version=newest, version_spread=newest - min(versions, default=0),
                     consensus_distance=consensus_distance([(r.version, r.digest, r.sketch) for r in records
                                                            if r.sketch]),
                     reducers=[r["name"] or r["peer"][-8:] for r in reducers])
    if before is not None and view.at > before.at:
        rate = 60.0 * (view.newest_version - before.newest_version) / (view.at - before.at)
        view = dataclasses.replace(view, rounds_per_minute=max(rate, 0.0))
    return view


def fragments_view(run_id: str, views: list[SwarmView], before: Optional[SwarmView] = None) -> SwarmView:
    """A swarm of P fragments (each a swarm of its own: `views`, in fragment order) as one view: a row per peer
    from fragment 0's swarm, with each fragment's version (a peer's fragments at different versions is the
    normal case), its version the sum of them, and each fragment's newest version and spread."""
    by_peer: dict[str, list[Optional[int]]] = {}
    for i, view in enumerate(views):
        for p in view.peers:
            by_peer.setdefault(p.peer, [None] * len(views))[i] = p.version
    peers = [dataclasses.replace(p, version=sum(v or 0 for v in by_peer[p.peer]), versions=tuple(by_peer[p.peer]))
             for p in views[0].peers]
    newest = sum(v.newest_version for v in views)
    view = dataclasses.replace(views[0], run_id=run_id, peers=peers, newest_version=newest,
                               version_spread=max(v.version_spread for v in views),
                               consensus_distance=max(v.consensus_distance for v in views), rounds_per_minute=None,
                               fragments=[dict(newest_version=v.newest_version, version_spread=v.version_spread,
                                               peers=len(v.peers)) for v in views])
    if before is not None and view.at > before.at:  # fragment rounds per minute, all fragments together
        view = dataclasses.replace(view, rounds_per_minute=max(60.0 * (newest - before.newest_version)
                                                               / (view.at - before.at), 0.0))
    return view


def _peer_view(r: PeerRecord, age: Optional[float]) -> PeerView:
    return PeerView(name=r.name, peer=r.peer[-8:], version=r.version, tokens_per_s=r.tokens_per_s,
                    loss=r.loss if r.inner_step else None, island=r.island, rounds=r.rounds,
                    bytes_sent=r.bytes_sent, client_mode=r.client_mode, devices=r.devices,
                    seen_seconds_ago=None if age is None else round(age, 1),
                    ready=r.ready >= 0, merging=r.merging >= 0)


def table(view: SwarmView):
    """A rich renderable: one row per peer, the totals in the caption."""
    from rich.table import Table

    rpm = "-" if view.rounds_per_minute is None else f"{view.rounds_per_minute:.2f}"
    kind = f", {len(view.fragments)} fragments (a peer's version: each fragment's)" if view.fragments else ""
    t = Table(title=f"swarm {view.run_id!r}: {len(view.peers)} peers{kind}",
              caption=f"{view.tokens_per_s:,.0f} tokens/s · version {view.newest_version} "
                      f"(spread {view.version_spread}) · {rpm} rounds/min · consensus distance "
                      f"{view.consensus_distance:.3g}\nreducer nodes: {', '.join(view.reducers) or 'none'}"
                      f"{_nobody_reduces(view)}")
    for column in ("name", "id", "devices", "version", "tokens/s", "loss", "island", "rounds", "sent", "mode", "seen"):
        t.add_column(column, justify="left" if column in ("name", "id", "mode") else "right")
    for p in view.peers:
        version = str(p.version) if not p.versions else " ".join("-" if v is None else str(v) for v in p.versions)
        t.add_row(p.name, p.peer, str(p.devices), version, f"{p.tokens_per_s:,.0f}",
                  "-" if p.loss is None else f"{p.loss:.3f}", str(p.island or "-"), str(p.rounds),
                  _bytes(p.bytes_sent), ("client" if p.client_mode else "full") + _activity(p),
                  "-" if p.seen_seconds_ago is None else f"{p.seen_seconds_ago:.0f}s ago")
    return t


def _nobody_reduces(view: SwarmView) -> str:
    if view.peers and not view.reducers and all(p.client_mode for p in view.peers):
        return " (every peer is in client mode: no island can form without a public peer or a reducer node)"
    return ""


def _activity(p: PeerView) -> str:
    return " · merging" if p.merging else " · ready" if p.ready else ""


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


RATE_WINDOW = 60.0  # seconds of views the rounds-per-minute figure is taken over


def run_status(cfg, as_json: bool, watch: bool, interval: float, echo=print, max_views: Optional[int] = None) -> None:
    """Join the DHT as a client, show the swarm once (or every `interval` seconds with `watch`), leave."""
    import json

    from p2pdiloco.swarm.fragments import fragment_config
    from p2pdiloco.swarm.node import start_dht
    from p2pdiloco.swarm.records import fetch_records_seen, fetch_reducers
    from p2pdiloco.swarm.signing import Identity

    dht = start_dht(cfg, Identity.fresh(), client_mode=True)  # an onlooker of its own, whatever --identity says
    try:
        views: list[SwarmView] = []

        runs = [fragment_config(cfg, i, cfg.fragments).run_id for i in range(cfg.fragments)]

        def observe() -> SwarmView:
            recent = [v for v in views if v.at >= time.monotonic() - RATE_WINDOW]
            before = recent[0] if recent else None
            if cfg.fragments == 1:
                view = view_of(cfg.run_id, fetch_records_seen(dht, cfg.run_id), before, fetch_reducers(dht, cfg.run_id))
            else:  # each fragment's swarm, as its fields in the peers' records (PeerRecord.lanes) tell it
                seen = fetch_records_seen(dht, cfg.run_id)
                view = fragments_view(cfg.run_id, [view_of(run, [(r.lane(i), age) for r, age in seen if r.lane(i)])
                                                   for i, run in enumerate(runs)], before)
            views[:] = recent + [view]
            return view

        if not watch:
            view = observe()
            echo(json.dumps(view.as_dict()) if as_json else _render(table(view)))
            return
        if as_json:  # one JSON line per refresh: for scripts and log shippers
            for _ in _ticks(interval, max_views):
                echo(json.dumps(observe().as_dict()))
            return
        from rich.live import Live

        with Live(table(observe()), auto_refresh=False) as live:
            for _ in _ticks(interval, max_views):
                live.update(table(observe()), refresh=True)
    finally:
        dht.shutdown()


def _ticks(interval: float, limit: Optional[int]):
    n = 0
    while limit is None or n < limit:
        yield n
        n += 1
        time.sleep(interval)


def _render(renderable) -> str:
    import io

    from rich.console import Console

    console = Console(width=120, file=io.StringIO())
    console.print(renderable)
    return console.file.getvalue().rstrip()
