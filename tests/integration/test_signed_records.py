"""Over a real DHT: a peer's record can be published, changed or withdrawn only by that peer (issue 51, item 4)."""

import dataclasses

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from p2pdiloco.config import SwarmConfig
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.swarm import node
from p2pdiloco.swarm.records import TTL, Heartbeat, fetch_records, records_key
from p2pdiloco.swarm.signing import Identity

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

BASE = SwarmConfig(run_id="signed", connect_timeout=20.0)
DIGEST = "abcdef0123456789"


def test_records_forged_in_an_honest_peers_name_are_ignored_and_cannot_replace_or_withdraw_its_own():
    honest_id, forger_id = Identity.fresh(), Identity.fresh()
    started = [node.start_dht(BASE, honest_id)]
    try:
        cfg = dataclasses.replace(BASE, initial_peers=tuple(node.visible_addresses(started[0])))
        onlooker = node.start_dht(cfg, Identity.fresh())
        started.append(onlooker)
        signing_forger = node.start_dht(cfg, forger_id)  # signs what it stores under its own subkey
        started.append(signing_forger)
        raw_forger = DHT(initial_peers=list(cfg.initial_peers), start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         nat_port_map=False, auto_nat=False, use_relay=False)  # signs and checks nothing
        started.append(raw_forger)
        assert node.peer_id(started[0]) == honest_id.peer_id  # the key that signs is the libp2p identity

        Heartbeat(started[0], BASE.run_id, PeerRecord(honest_id.peer_id, "a", 3, DIGEST), honest_id).publish()
        lie = PeerRecord(honest_id.peer_id, "a", 99, DIGEST, ready=98).value()
        key, until = records_key(BASE.run_id), get_dht_time() + TTL
        raw_forger.store(key, subkey=honest_id.subkey, value=lie, expiration_time=until)  # unsigned, its subkey
        raw_forger.store(key, subkey=honest_id.subkey, value=None, expiration_time=until + 1)  # a withdrawal
        raw_forger.store(key, subkey=honest_id.peer_id, value=lie, expiration_time=until + 2)  # as before signing
        assert signing_forger.store(key, subkey=forger_id.subkey, value=lie, expiration_time=until + 3)  # own name

        seen = [(r.peer, r.version, r.ready) for r in fetch_records(onlooker, BASE.run_id)]
        assert seen == [(honest_id.peer_id, 3, -1)]
    finally:
        for dht in started:
            node.shutdown(dht)
