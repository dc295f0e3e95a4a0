"""The swarm view `p2pdiloco status` shows, from peer records: rows, totals, and records it must refuse."""

import dataclasses
import json

from p2pdiloco.ops.status import SwarmView, _render, table, view_of
from p2pdiloco.protocol.remote import PeerRecord, parse_peer_record


def record(name, version, digest="d" * 8, **fields):
    return PeerRecord(peer=f"Qm{name * 10}", name=name, version=version, digest=digest, **fields)


def test_the_view_sums_the_swarm_and_measures_disagreement_only_between_different_states():
    seen = [(record("a", 5, inner_step=40, tokens_per_s=100.0, loss=2.5, island=3, rounds=5, bytes_sent=10_000,
                    sketch=[1.0, 0.0]), 0.5),
            (record("b", 5, inner_step=40, tokens_per_s=150.0, loss=2.4, island=3, rounds=5, sketch=[1.0, 0.0]), 1.5),
            (record("c", 3, digest="e" * 8, tokens_per_s=50.0, sketch=[0.0, 1.0]), 2.0)]
    view = view_of("run", seen)
    assert [p.name for p in view.peers] == ["a", "b", "c"] and view.tokens_per_s == 300.0
    assert view.newest_version == 5 and view.version_spread == 2 and view.consensus_distance > 0
    assert view.peers[2].loss is None  # no inner step yet: no loss to show, not a fake 0
    assert view_of("run", seen[:2]).consensus_distance == 0  # same digest: the same state
    printed = json.loads(json.dumps(view.as_dict()))  # what --json prints
    assert printed["n_peers"] == 3 and printed["tokens_per_s"] == 300.0 and "at" not in printed
    assert [p["name"] for p in printed["peers"]] == ["a", "b", "c"] and printed["newest_version"] == 5
    assert printed["consensus_distance"] == view.consensus_distance == 2 ** 0.5  # sketches [1, 0] and [0, 1]


def test_rounds_per_minute_come_from_two_views_of_the_newest_version():
    before = view_of("run", [(record("a", 10), 0.0)])
    later = view_of("run", [(record("a", 13), 0.0)], before=dataclasses.replace(before, at=before.at - 30.0))
    assert abs(later.rounds_per_minute - 6.0) < 0.01 and before.rounds_per_minute is None


def test_the_table_has_a_row_per_peer_and_the_totals():
    view = view_of("run", [(record("alpha", 2, inner_step=1, loss=3.25, bytes_sent=2_500_000, island=2), 1.0),
                           (record("beta", 2, ready=2, merging=2), 4.0), (record("gamma", 2, ready=2), 4.0)])
    text = _render(table(view))
    assert "alpha" in text and "beta" in text and "3.250" in text and "2.5 MB" in text and "3 peers" in text
    assert "full · merging" in text and "full · ready" in text  # beta's island is closed to others; gamma looks
    rows = {cells[0]: line for line in text.splitlines()
            if len(cells := line.strip("│ ").split()) > 1 and cells[0] in ("alpha", "beta", "gamma")}
    assert "3.250" in rows["alpha"] and "2.5 MB" in rows["alpha"] and "merging" in rows["beta"]
    assert "ready" in rows["gamma"] and "merging" not in rows["gamma"] and "3.250" not in rows["beta"]


def test_the_table_names_the_reducer_nodes_and_says_when_nobody_can_reduce():
    clients = [(record("a", 1, client_mode=True), 1.0), (record("b", 1, client_mode=True), 1.0)]
    stuck = _render(table(view_of("run", clients)))
    assert "reducer nodes: none" in stuck and "no island can form" in stuck and "client" in stuck
    served = _render(table(view_of("run", clients, reducers=[dict(peer="Qm" + "z" * 20, name="vps")])))
    assert "reducer nodes: vps" in served and "no island can form" not in served
    mixed = _render(table(view_of("run", [*clients, (record("c", 1), 1.0)])))
    assert "no island can form" not in mixed  # c is public: it reduces
    assert json.loads(json.dumps(view_of("run", clients, reducers=[dict(peer="Qm" + "z" * 20, name="")]).as_dict())
                      )["reducers"] == ["zzzzzzzz"]


def test_status_fields_from_the_network_are_validated_like_every_other_field():
    good = (record("a", 1, loss=2.0, island=3, rounds=4, bytes_sent=5, client_mode=True)).value()
    assert parse_peer_record(good) is not None
    for field, bad in (("loss", float("nan")), ("loss", -1.0), ("island", -1), ("rounds", "7"),
                       ("bytes_sent", 2.5), ("client_mode", "yes"), ("client_mode", 1)):
        assert parse_peer_record(dict(good, **{field: bad})) is None, (field, bad)


def test_a_fragmented_swarm_shows_each_peers_fragments_at_their_own_versions():
    from p2pdiloco.ops.status import fragments_view
    f0 = view_of("run_f0of2", [(record("a", 3, tokens_per_s=100.0), 0.5), (record("b", 3, tokens_per_s=90.0), 0.5)])
    f1 = view_of("run_f1of2", [(record("a", 2), 0.5), (record("b", 1, digest="e" * 8), 0.5)])
    view = fragments_view("run", [f0, f1])
    assert [(p.name, p.versions, p.version) for p in view.peers] == [("a", (3, 2), 5), ("b", (3, 1), 4)]
    assert view.newest_version == 5 and view.version_spread == 1 and view.tokens_per_s == 190.0
    assert view.fragments == [dict(newest_version=3, version_spread=0, peers=2),
                              dict(newest_version=2, version_spread=1, peers=2)]
    text = _render(table(view))
    assert "2 fragments" in text and "3 2" in text and "3 1" in text
    later = fragments_view("run", [view_of("x", [(record("a", 4), 0.5)]), view_of("y", [(record("a", 3), 0.5)])],
                           before=dataclasses.replace(view, at=view.at - 60.0))
    assert abs(later.rounds_per_minute - 2.0) < 0.05  # 7 - 5 fragment rounds in a minute
    assert json.loads(json.dumps(view.as_dict()))["peers"][0]["versions"] == [3, 2]
