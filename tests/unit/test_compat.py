"""A peer whose settings cannot merge with the swarm's is told which setting differs, at join."""

from p2pdiloco.config import OuterConfig, PeerConfig
from p2pdiloco.protocol.compat import mismatch
from p2pdiloco.protocol.remote import WIRE_VERSION, PeerRecord, parse_peer_record

SWARM = dict(model="small", parameters="3000000", compression="int4", topk="off", weighting="tokens2")


def live(settings: dict, name: str = "p") -> PeerRecord:
    return PeerRecord(peer=name, name=name, version=3, digest="abcdef", settings=settings)


def test_the_first_differing_setting_is_named_with_ours_and_the_swarms():
    others = [live(SWARM, "a"), live(SWARM, "b"), live(dict(SWARM, compression="none"), "c")]
    assert mismatch(SWARM, others) is None  # we agree with most of them
    why = mismatch(dict(SWARM, compression="none"), others)
    assert "compression is 'none' but the swarm's is 'int4' (2 of 3 live peers)" in why and "--run-id" in why
    assert "model is 'tiny'" in mismatch(dict(SWARM, model="tiny"), others)


def test_peers_that_publish_no_settings_are_not_compared():
    assert mismatch(SWARM, [live({})]) is None and mismatch(SWARM, []) is None


def test_published_settings_are_validated_like_any_remote_field():
    base = dict(peer="p", name="n", version=1, digest="abcdef", wire=WIRE_VERSION)
    assert parse_peer_record(dict(base, settings=SWARM)).settings == SWARM
    for bad in ([1], {"k": 1}, {"": "v"}, {"k" * 40: "v"}, {"k": "v" * 100}, {str(i): "v" for i in range(40)}):
        assert parse_peer_record(dict(base, settings=bad)) is None
    # a member of several ranks says how many; one that says nothing has one
    assert parse_peer_record(base).devices == 1 and parse_peer_record(dict(base, devices=8)).devices == 8
    for bad in (0, -1, True, 2.0, 1 << 20):
        assert parse_peer_record(dict(base, devices=bad)) is None


def test_peers_with_another_outer_step_are_refused_as_they_would_fork_at_the_first_merge():
    """Each member applies the outer step to the merged Δ itself: another lr or momentum gives another Θ'."""
    swarm = [live(PeerConfig().merge_settings(1000), p) for p in "ab"]
    assert mismatch(PeerConfig().merge_settings(1000), swarm) is None
    sparseloco = PeerConfig(outer=OuterConfig(lr=1.0, momentum=0.0)).merge_settings(1000)
    assert "outer_lr is '1' but the swarm's is '0.7'" in mismatch(sparseloco, swarm)
    default = f"{OuterConfig().momentum:g}"  # the swarm's peers run the default
    assert f"outer_momentum is '0' but the swarm's is '{default}'" in mismatch(dict(sparseloco, outer_lr="0.7"), swarm)


def test_a_record_of_another_wire_version_is_counted_not_parsed_and_named_at_join():
    from collections import Counter

    from p2pdiloco.protocol.compat import wire_mismatch
    from p2pdiloco.protocol.remote import WIRE_VERSION, record_wire

    ours = dict(peer="p", name="n", version=1, digest="abcdef", wire=WIRE_VERSION)
    assert parse_peer_record(ours).wire == WIRE_VERSION
    for other, version in ((dict(ours, wire=WIRE_VERSION + 1), WIRE_VERSION + 1), ({**ours, "wire": "2"}, -1),
                           ({k: v for k, v in ours.items() if k != "wire"}, 0)):  # 0: from before versions
        assert parse_peer_record(other) is None and record_wire(other) == version
    why = wire_mismatch(Counter({WIRE_VERSION + 1: 3}), live=1)
    assert (f"this peer speaks wire version {WIRE_VERSION} but 3 of 4 live peers speak wire version "
            f"{WIRE_VERSION + 1}: upgrade p2pdiloco") in why and "\n" not in why
    assert "older p2pdiloco" in wire_mismatch(Counter({0: 2}), live=0)
    assert wire_mismatch(Counter({WIRE_VERSION + 1: 1}), live=2) is None  # most speak ours: join them
    assert wire_mismatch(Counter(), live=0) is None


def test_the_swarm_driver_counts_the_other_wire_versions_it_finds_on_the_dht():
    import concurrent.futures
    from types import SimpleNamespace

    from p2pdiloco.protocol.remote import WIRE_VERSION
    from p2pdiloco.swarm.records import fetch_records, other_wires
    from p2pdiloco.swarm.signing import Identity

    a, b, c, d, x = (Identity.fresh() for _ in range(5))
    mine = live(SWARM, a.peer_id).value()
    table = {a.subkey: mine, b.subkey: dict(mine, peer=b.peer_id, wire=WIRE_VERSION + 1),
             c.subkey: dict(mine, peer=c.peer_id, wire=WIRE_VERSION + 9),
             d.subkey: dict(mine, peer=d.peer_id, wire=WIRE_VERSION + 1),
             "e": "not a record",
             # a flood of unsigned records, or records in another's name, claiming another version: not counted, or
             # anyone could stop every peer that joins ("most live peers speak another version")
             **{f"forged{i}": dict(mine, peer=f"forged{i}", wire=WIRE_VERSION + 1) for i in range(9)},
             x.subkey: dict(mine, peer=b.peer_id, wire=WIRE_VERSION + 1)}

    class TableDHT:
        def get(self, key, latest=True, return_future=False):
            future = concurrent.futures.Future()
            future.set_result(SimpleNamespace(value={k: SimpleNamespace(value=v) for k, v in table.items()}))
            return future

    assert other_wires(TableDHT(), "run") == {WIRE_VERSION + 1: 2, WIRE_VERSION + 9: 1}
    assert [r.peer for r in fetch_records(TableDHT(), "run")] == [a.peer_id]


def test_a_setting_only_one_side_has_is_named_as_not_set():
    """A setting the swarm publishes and we lack (an older peer), or the reverse, is a difference too."""
    why = mismatch(SWARM, [live(dict(SWARM, rda="on"), "a")])
    assert "this peer's rda is '(not set)' but the swarm's is 'on' (1 of 1 live peers)" in why
    why = mismatch(dict(SWARM, rda="on"), [live(SWARM, "a"), live(SWARM, "b")])
    assert "this peer's rda is 'on' but the swarm's is '(not set)' (2 of 2 live peers)" in why


def test_the_swarms_value_is_the_most_common_one_and_the_count_is_of_it():
    others = [live(dict(SWARM, compression=c), str(i)) for i, c in enumerate(["none", "int8", "int8", "int4"])]
    why = mismatch(dict(SWARM, compression="int4"), others)
    assert "the swarm's is 'int8' (2 of 4 live peers)" in why


def test_a_wire_mismatch_needs_more_peers_of_the_other_version_than_of_ours():
    from collections import Counter

    from p2pdiloco.protocol.compat import wire_mismatch
    from p2pdiloco.protocol.remote import WIRE_VERSION

    assert wire_mismatch(Counter({WIRE_VERSION + 1: 2}), live=2) is None  # a tie: stay with ours
    mixed = Counter({WIRE_VERSION + 1: 3, WIRE_VERSION + 9: 1})
    assert "3 of 4 live peers speak wire version" in wire_mismatch(mixed, live=0)
    assert wire_mismatch(mixed, live=0).count(f"{WIRE_VERSION + 1}") >= 1
    assert "speak an unreadable version: the swarm runs an older p2pdiloco" in wire_mismatch(Counter({-1: 1}), 0)
    said = wire_mismatch(Counter({0: 1}), live=0)  # peers from before versions were published
    assert "speak wire version 0: the swarm runs an older p2pdiloco: run the same release" in said
    newer = wire_mismatch(Counter({WIRE_VERSION + 1: 1}), live=0)
    assert f"speak wire version {WIRE_VERSION + 1}: upgrade p2pdiloco, or start another swarm" in newer
