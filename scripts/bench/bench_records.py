"""What the swarm's control traffic costs on the wire: bytes per records fetch and per heartbeat, measured on the
loopback interface of a private network namespace (nothing else uses it), for N peers whose heartbeats publish
records as a peer's do (signed, with a sketch and the join settings).

    unshare -n bash -c 'ip link set lo up && .venv/bin/python scripts/bench/bench_records.py --peers 4'

Phases, each `--seconds` long: the DHT's upkeep alone; each peer storing its record every heartbeat, with no
fetch; the heartbeats (a store every beat, and a view of everyone's records: `beat_fetches` counts the beats that
fetched every copy); then one peer also reading the records every `--poll` seconds (a round waiting for peers:
`RoundRules.poll`), first from every replica's copy, then from any copy stored within `records.POLL_LAG` (our
node's own first: the read `Heartbeat.poll` makes before it falls back to every copy, which `--freshness`
exercises). With `--freshness K`, K times each: one peer changes
its record, and another peer polls as a round does (`Heartbeat.poll`), or its node fetches every copy, every
`--poll` seconds until it sees the change: how far behind a poll is, where a swarm of more than 5 nodes leaves our
node without a replica of the records.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.config import PeerConfig, SwarmConfig
from p2pdiloco.core.consensus import sketch_dim
from p2pdiloco.core.fragments import RULE as FRAGMENT_RULE
from p2pdiloco.ops.testbed import loopback_bytes_sent
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.swarm import node
from p2pdiloco.swarm.records import HEARTBEAT, POLL_LAG, Heartbeat, fetch_records
from p2pdiloco.swarm.signing import Identity

# the join settings a peer of `tiny` publishes (Workload.settings: the model's, tokenizer's and data's hashes, the merge
# rule and the outer step)
SETTINGS = PeerConfig(model="tiny").merge_settings(1_787_008, dict(
    model_config="0123456789abcdef", tokenizer="0123456789abcdef", data="0123456789abcdef", norms="0"))


def measure(seconds: float, each=None, every: float = 0.0) -> tuple[float, int]:
    """Loopback bytes per second over `seconds`, and how many times `each` ran (every `every` s)."""
    start, t0, calls = loopback_bytes_sent(), time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        if each is not None:
            each()
            calls += 1
        time.sleep(every if each is not None else 0.5)
    return (loopback_bytes_sent() - start) / (time.monotonic() - t0), calls


def seen_after(beat: Heartbeat, read, version: int, poll: float, limit: float = 10.0) -> float:
    """Seconds from `beat` publishing `version` until `read()` (every `poll` s) returns it (`limit` where it never
    does)."""
    beat.update(version=version)
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if any(r.peer == beat.record.peer and r.version >= version for r in read()):
            return time.monotonic() - start
        time.sleep(poll)
    return limit


def freshness(beats: list, poller: int, run_id: str, trials: int, poll: float) -> dict:
    """How long a change to the last peer's record takes to show in peer `poller`'s polls (`Heartbeat.poll`, as a
    round waiting for peers reads) and in its node's fetches of every copy, alternately, at random moments."""
    import random
    import statistics

    delays = {"poll": [], "fetch": []}
    reads = dict(poll=beats[poller].poll, fetch=lambda: fetch_records(beats[poller].dht, run_id))
    version = beats[-1].record.version
    for trial in range(trials):
        for kind, read in reads.items():
            time.sleep(random.uniform(0, HEARTBEAT))
            version += 1
            delays[kind].append(seen_after(beats[-1], read, version, poll))
    return {f"{kind}_seen_after_s": dict(median=round(statistics.median(d), 3), max=round(max(d), 3),
                                         all=[round(x, 3) for x in d]) for kind, d in delays.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--poll", type=float, default=0.25)
    parser.add_argument("--poll-lag", type=float, default=POLL_LAG, help="the polls' lag (records.POLL_LAG)")
    parser.add_argument("--fragments", type=int, default=1, help="records as a peer of P fragments publishes them")
    parser.add_argument("--freshness", type=int, default=0, help="trials of how far behind a poll is (0: none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    base = SwarmConfig(run_id="bench-records", connect_timeout=30.0)
    dhts, beats = [node.start_dht(base, Identity.fresh())], []
    try:
        cfg = dataclasses.replace(base, initial_peers=tuple(node.visible_addresses(dhts[0])))
        for i in range(args.peers):
            identity = Identity.fresh()
            dht = node.start_dht(cfg, identity)
            dhts.append(dht)
            values = sketch_dim(args.fragments)  # a peer's fragments share one budget of sketch values
            lanes = [dict(version=12, digest=f"{j:016x}", merged_by=4, sketch=[0.123456789] * values, rounds=12,
                          island=4, bytes_sent=12345678) for j in range(1, args.fragments)]
            record = PeerRecord(peer=identity.peer_id, name=f"p{i}", version=12, digest="0123456789abcdef",
                                sketch=[0.123456789] * values,
                                settings=dict(SETTINGS, **({"fragments": f"{args.fragments}:{FRAGMENT_RULE}"}
                                                           if args.fragments > 1 else {})),
                                inner_step=1234, tokens_per_s=5678.9, loss=2.5, rounds=12, island=4,
                                bytes_sent=123456789, merged_by=4, lanes=lanes)
            beats.append(Heartbeat(dht, cfg.run_id, record, identity))
        time.sleep(3)
        dht_only, _ = measure(args.seconds)  # the DHT's own upkeep
        stores, _ = measure(args.seconds, lambda: [b.publish() for b in beats], HEARTBEAT)  # every beat's store
        for beat in beats:
            beat.start()
        deadline = time.monotonic() + 60
        while len(fetch_records(dhts[1], cfg.run_id)) < args.peers and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(3)
        before = [getattr(beat, "fetches", 0) for beat in beats]  # (builds before the counter: 0)
        idle, _ = measure(args.seconds)  # heartbeats: a store every beat, and a view of everyone's records
        beat_fetches = [getattr(beat, "fetches", 0) - b for beat, b in zip(beats, before)]  # of every copy, per peer
        polling, gets = measure(args.seconds, lambda: fetch_records(dhts[1], cfg.run_id), args.poll)
        # as a round polls (records.POLL_LAG): our node's own copy while its newest record is recent enough
        polling_lag, lag_gets = measure(args.seconds, lambda: fetch_records(dhts[1], cfg.run_id, lag=args.poll_lag),
                                        args.poll)
        size = len(MSGPackSerializer.dumps(beats[0].record.value()))
        per_peer = (lambda rate: round(rate / args.peers))
        result = dict(peers=args.peers, seconds=args.seconds, poll=args.poll, fragments=args.fragments,
                      record_bytes=size,
                      dht_upkeep_bytes_per_s=round(dht_only), stores_bytes_per_s=round(stores),
                      heartbeats_bytes_per_s=round(idle), beat_fetches=beat_fetches,
                      polling_bytes_per_s=round(polling), fetches=gets,
                      bytes_per_fetch=round((polling - idle) * args.seconds / max(1, gets)),
                      poll_lag=args.poll_lag, polling_lag_bytes_per_s=round(polling_lag), polls=lag_gets,
                      bytes_per_poll=round((polling_lag - idle) * args.seconds / max(1, lag_gets)),
                      bytes_per_store=round((stores - dht_only) * HEARTBEAT / args.peers),
                      heartbeat_bytes_per_peer_per_s=per_peer(idle - dht_only),
                      of_which_stores_per_peer_per_s=per_peer(stores - dht_only))
        if args.freshness:
            # the peer whose beats fetched every copy most (its node holds no replica), where the build counts them
            poller = max(range(args.peers - 1), key=lambda i: beat_fetches[i])
            result.update(nodes=len(dhts), poller=poller,
                          **freshness(beats, poller, cfg.run_id, args.freshness, args.poll))
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    finally:
        for beat in beats:
            beat.stop()
        for dht in dhts:
            node.shutdown(dht)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
