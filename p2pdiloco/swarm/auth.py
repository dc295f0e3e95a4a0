"""The swarm key: a shared secret without which a peer cannot use the swarm's DHT. Without the DHT it finds no
peer records, no islands and no donors, and it cannot write records of its own.

Every DHT request and response carries an HMAC-SHA256 under the key. Requests are stamped with a time and a
nonce, so an overheard request cannot be replayed. This is hivemind's own seam (`AuthorizerBase`, which its
token-based authorizer and its tests use), with a shared secret instead of an authority's RSA signatures. The
key is read from --swarm-key-file or P2PDILOCO_SWARM_KEY; it is never logged, and the config holds only the
path.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Optional

from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

ENV = "P2PDILOCO_SWARM_KEY"
MIN_KEY_BYTES = 16
MAX_SKEW = 60.0  # seconds between a request's time stamp and ours (hivemind's token authorizer allows the same)


class SwarmKeyError(ValueError):
    """The swarm key cannot be read or is too short; the message says what to do (and never shows the key)."""


def load_swarm_key(path: Optional[Path]) -> Optional[bytes]:
    """The key from the file if given, else from the environment; None: an open swarm."""
    if path is not None:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as e:
            raise SwarmKeyError(f"--swarm-key-file {path}: cannot read it ({e.strerror or e})") from None
        source = f"--swarm-key-file {path}"
    elif os.environ.get(ENV):
        key, source = os.environ[ENV].strip().encode(), ENV
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise SwarmKeyError(f"{source}: the swarm key must be at least {MIN_KEY_BYTES} bytes (make one with: "
                            f"python -c 'import secrets; print(secrets.token_hex(32))')")
    return key


PASS_BYTES = 16


class MemberPasses:
    """Makes and checks the passes of a swarm's key (derived apart from the DHT's key: one never opens the other)."""

    def __init__(self, key: bytes):
        self._key = hashlib.sha256(b"p2pdiloco member pass\0" + key).digest()

    def __repr__(self) -> str:
        return "MemberPasses(<key>)"

    def of(self, peer_id: str) -> bytes:
        return hmac.new(self._key, peer_id.encode(), hashlib.sha256).digest()[:PASS_BYTES]

    def valid(self, peer_id: str, token) -> bool:
        return isinstance(token, bytes) and hmac.compare_digest(token, self.of(peer_id))


class SwarmKeyAuthorizer(AuthorizerBase):
    def __init__(self, key: bytes):
        self._key = hashlib.sha256(b"p2pdiloco swarm key\0" + key).digest()  # the key itself never travels
        self._nonces: Optional[TimedStorage] = None

    def __getstate__(self):  # the DHT runs in its own process: only the derived key goes there
        return {"_key": self._key, "_nonces": None}

    def __repr__(self) -> str:
        return "SwarmKeyAuthorizer(<key>)"

    def _mac(self, message) -> bytes:
        return hmac.new(self._key, message.SerializeToString(), hashlib.sha256).digest()

    def _signed_by_key(self, message) -> bool:
        signature = message.auth.signature
        message.auth.signature = b""
        try:
            return hmac.compare_digest(signature, self._mac(message))
        finally:
            message.auth.signature = signature

    async def sign_request(self, request, service_public_key) -> None:
        request.auth.time = get_dht_time()
        request.auth.nonce = secrets.token_bytes(8)
        request.auth.signature = b""
        request.auth.signature = self._mac(request)

    async def validate_request(self, request) -> bool:
        if not self._signed_by_key(request):
            return False
        now = get_dht_time()
        if abs(request.auth.time - now) > MAX_SKEW:
            return False
        if self._nonces is None:
            self._nonces = TimedStorage()
        with self._nonces.freeze():
            if request.auth.nonce in self._nonces:
                return False  # replayed
        self._nonces.store(request.auth.nonce, None, now + 2 * MAX_SKEW)
        return True

    async def sign_response(self, response, request) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = b""
        response.auth.signature = self._mac(response)

    async def validate_response(self, response, request) -> bool:
        return response.auth.nonce == request.auth.nonce and self._signed_by_key(response)
