"""The swarm key's authorizer on real hivemind DHT messages: only a holder of the key can sign, nothing signed
can be altered or replayed, and the key itself is never shown."""

import asyncio
import pickle

import pytest
from hivemind.proto import dht_pb2

from p2pdiloco.swarm.auth import MAX_SKEW, SwarmKeyAuthorizer, SwarmKeyError, load_swarm_key

KEY = b"a-swarm-key-of-32-bytes-or-so!!!"


def run(coro):
    return asyncio.run(coro)


def signed_request(key=KEY):
    request = dht_pb2.PingRequest(validate=True)
    run(SwarmKeyAuthorizer(key).sign_request(request, None))
    return request


def test_a_request_signed_with_the_key_is_accepted_once():
    server = SwarmKeyAuthorizer(KEY)
    request = signed_request()
    assert run(server.validate_request(request))
    assert not run(server.validate_request(request))  # the same request again: a replay


def test_a_wrong_key_or_an_altered_request_is_refused():
    server = SwarmKeyAuthorizer(KEY)
    assert not run(server.validate_request(signed_request(b"another-key-of-32-bytes-or-so!!!")))
    assert not run(server.validate_request(dht_pb2.PingRequest(validate=True)))  # unsigned
    altered = signed_request()
    altered.validate = False
    assert not run(server.validate_request(altered))


def test_a_stale_request_is_refused():
    request = dht_pb2.PingRequest()
    authorizer = SwarmKeyAuthorizer(KEY)
    run(authorizer.sign_request(request, None))
    request.auth.time -= 2 * MAX_SKEW
    request.auth.signature = b""
    request.auth.signature = authorizer._mac(request)  # correctly signed, but old
    assert not run(SwarmKeyAuthorizer(KEY).validate_request(request))


def test_responses_must_answer_this_request_under_the_key():
    client, server = SwarmKeyAuthorizer(KEY), SwarmKeyAuthorizer(KEY)
    request = signed_request()
    response = dht_pb2.PingResponse(available=True)
    run(server.sign_response(response, request))
    assert run(client.validate_response(response, request))
    other = signed_request()
    assert not run(client.validate_response(response, other))  # an answer to another request
    forged = dht_pb2.PingResponse(available=True)
    run(SwarmKeyAuthorizer(b"another-key-of-32-bytes-or-so!!!").sign_response(forged, request))
    assert not run(client.validate_response(forged, request))


def test_the_key_is_never_shown_nor_shipped_to_the_dht_process_as_is():
    authorizer = SwarmKeyAuthorizer(KEY)
    assert KEY not in pickle.dumps(authorizer) and KEY.decode() not in repr(authorizer)


def test_the_key_comes_from_a_file_or_the_environment_and_errors_never_show_it(tmp_path, monkeypatch):
    monkeypatch.delenv("P2PDILOCO_SWARM_KEY", raising=False)
    assert load_swarm_key(None) is None  # an open swarm
    (tmp_path / "key").write_bytes(KEY + b"\n")
    assert load_swarm_key(tmp_path / "key") == KEY
    monkeypatch.setenv("P2PDILOCO_SWARM_KEY", KEY.decode())
    assert load_swarm_key(None) == KEY
    (tmp_path / "short").write_bytes(b"hunter2")
    with pytest.raises(SwarmKeyError, match="at least 16 bytes") as e:
        load_swarm_key(tmp_path / "short")
    assert "hunter2" not in str(e.value)
    with pytest.raises(SwarmKeyError, match="cannot read it"):
        load_swarm_key(tmp_path / "missing")
