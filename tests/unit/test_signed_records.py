"""Records on the DHT are signed by the key behind the publisher's peer id: one in another peer's name is ignored."""

import concurrent.futures
import dataclasses
from types import SimpleNamespace

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

from p2pdiloco.config import SwarmConfig
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.swarm import node, records, staterelay
from p2pdiloco.swarm.signing import Identity, IdentityError, owner_peer
from tests.harness.dht import StoringDHT

HONEST, FORGER = Identity.fresh(), Identity.fresh()


def test_an_identity_is_the_libp2p_identity_its_file_gives_p2pd(tmp_path):
    """The peer id our records are checked against is the one libp2p derives from the same key file."""
    path = tmp_path / "id.key"
    kept = Identity.at(path)  # made there
    assert kept.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()
    assert Identity.at(path).peer_id == kept.peer_id  # loaded again: the same peer across restarts
    made_by_hivemind = tmp_path / "hivemind.key"
    P2P.generate_identity(str(made_by_hivemind))  # as older runs' `--identity` files were made
    assert Identity.load(made_by_hivemind).peer_id == PeerID.from_identity(made_by_hivemind.read_bytes()).to_base58()
    assert owner_peer(kept.subkey) == kept.peer_id and owner_peer(kept.peer_id) is None
    assert owner_peer(b"[owner:ssh-rsa notakey]") is None and owner_peer(None) is None


@pytest.mark.parametrize("content, says", [
    (crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=b"\x01" * 64).SerializeToString(),
     "a key of type Ed25519"),
    (b"\xff\x00 not a key", "not a libp2p private key file"),
    (crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=b"garbage").SerializeToString(),
     "not a libp2p private key file"),
])
def test_an_identity_we_cannot_sign_with_is_refused_in_one_line(tmp_path, content, says):
    path = tmp_path / "id.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError, match=says) as caught:
        Identity.load(path)
    assert "\n" not in str(caught.value)
    with pytest.raises(node.SwarmConnectError, match=says):
        node.identity_of(SwarmConfig(identity=path))
    assert path.read_bytes() == content  # nothing is lost


def test_an_identity_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    where = tmp_path / "no such folder" / "id.key"
    with pytest.raises(node.SwarmConnectError, match="cannot write it") as caught:
        node.identity_of(SwarmConfig(identity=where))
    assert "\n" not in str(caught.value) and not where.parent.exists()
    kept = tmp_path / "id.key"
    (tmp_path / "id.key.tmp").write_bytes(b"a try that died")
    (tmp_path / "id.key.tmp").chmod(0o400)
    assert Identity.at(kept).peer_id == PeerID.from_identity(kept.read_bytes()).to_base58()
    assert not (tmp_path / "id.key.tmp").exists()


def signed(identity: Identity, subkey, value) -> DHTRecord:
    """What `identity`'s DHT node would store: the record, signed where `subkey` is the identity's own."""
    record = DHTRecord(b"run.peers", MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), 1e12)
    return dataclasses.replace(record, value=identity.validator().sign_value(record))


def test_only_the_owner_of_a_subkey_can_store_under_it():
    """hivemind's validator, with our keys: a forger cannot sign under the honest peer's subkey, nor pass its own
    signature off as the honest peer's."""
    checker = Identity.fresh().validator()  # any node's
    assert checker.validate(signed(HONEST, HONEST.subkey, dict(version=3)))
    forged = signed(FORGER, HONEST.subkey, dict(version=99))  # the forger's node does not sign another's subkey
    assert not checker.validate(forged)
    own = signed(FORGER, FORGER.subkey, dict(version=99))
    assert not checker.validate(dataclasses.replace(forged, value=own.value))  # its signature, over its own subkey


class TableDHT:
    """What a DHT get returns: subkey -> value, as stored (the DHT has already dropped badly signed ones)."""

    def __init__(self, table: dict):
        self.table = table

    def get(self, key, latest=True, return_future=False):
        future = concurrent.futures.Future()
        future.set_result(SimpleNamespace(value={k: SimpleNamespace(value=v, expiration_time=None)
                                                 for k, v in self.table.items()}))
        return future


def test_a_record_in_another_peers_name_is_ignored():
    honest = PeerRecord(HONEST.peer_id, "a", 3, "abcdef0123456789").value()
    lie = dict(honest, version=99, ready=98)
    table = {HONEST.subkey: honest,
             HONEST.peer_id: lie,  # unsigned, under the honest peer's id (how records were stored before)
             FORGER.subkey: lie}  # signed, by the forger, naming the honest peer
    seen = records.fetch_records(TableDHT(table), "run")
    assert [(r.peer, r.version) for r in seen] == [(HONEST.peer_id, 3)]
    forger_as_itself = dict(lie, peer=FORGER.peer_id)
    seen = records.fetch_records(TableDHT({FORGER.subkey: forger_as_itself}), "run")
    assert [r.peer for r in seen] == [FORGER.peer_id]  # in its own name, it is a peer like any other


def test_a_reducer_announcement_or_a_want_in_another_peers_name_is_ignored():
    node_record = dict(peer=HONEST.peer_id, name="node")
    table = {HONEST.subkey: node_record, FORGER.subkey: dict(node_record, name="fake"), HONEST.peer_id: node_record}
    assert records.fetch_reducers(TableDHT(table), "run") == [node_record]
    want = dict(version=4, digest="ab" * 8, node=HONEST.peer_id)
    wants = staterelay.fetch_wants(TableDHT({FORGER.peer_id: want, HONEST.subkey: dict(want, version=5)}), "run")
    assert [w.key for w in wants] == [(5, "ab" * 8)]


def test_a_heartbeat_signs_only_its_own_peers_record():
    with pytest.raises(ValueError, match="cannot be signed"):
        records.Heartbeat(None, "run", PeerRecord(HONEST.peer_id, "a", 0, ""), FORGER)

    dht = StoringDHT()
    records.Heartbeat(dht, "run", PeerRecord(HONEST.peer_id, "a", 0, ""), HONEST).publish()
    records.announce_reducer(dht, "run", HONEST, "node")
    staterelay.want_state(dht, "run", HONEST, (4, "ab" * 8), "node")
    stored = [subkey for _, subkey, _ in dht.stored]
    assert stored == [HONEST.subkey] * 3
