"""Signed DHT records: what a peer publishes (its peer record, a reducer node's announcement, a want of state) is
signed by the key behind its libp2p peer id, so that nobody can publish, change or withdraw a record in its name.

hivemind's own seam does the signing and checking (`RSASignatureValidator`, which its optimizer's progress
records use): a record stored under the subkey `[owner:<RSA public key>]` must carry that key's signature, or
every DHT node with the validator refuses to store it and every reader drops it. What hivemind does not check is
that the key is the publisher's libp2p identity. So the peer's libp2p identity is that same RSA key (p2pd takes
it as its identity file), and a reader keeps only records whose owner key hashes to the peer id the record names
(`owner_peer`). A record under any other subkey, or one signed by one peer that names another, is ignored.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import base58
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import PrivateKey, RSAPublicKey

KEY_BITS = 2048  # as hivemind's own identities
_OWNER = re.compile(b"^" + RSASignatureValidator.PUBLIC_KEY_REGEX + b"$", re.DOTALL)
_SHA256_MULTIHASH = b"\x12\x20"  # multihash code and length of a sha2-256 digest (the libp2p peer-id spec)


class IdentityError(ValueError):
    """An identity file we cannot sign with; the message is one line."""


class IdentityKey(PrivateKey):
    """An RSA key as hivemind's validator wants one (its `RSAPublicKey.verify` is what checks our signatures),
    made from an identity file's key rather than a fresh one."""

    def __init__(self, key: rsa.RSAPrivateKey):
        self._key = key

    def sign(self, data: bytes) -> bytes:
        # hivemind's own signing scheme (PSS, SHA-256, base64), which its RSAPublicKey.verify checks: listed as a
        # seam (swarm/seams.py) with the test that fails should a release change it
        pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
        return base64.b64encode(self._key.sign(data, pss, hashes.SHA256()))

    def get_public_key(self) -> RSAPublicKey:
        return RSAPublicKey(self._key.public_key())

    def der(self) -> bytes:
        """PKCS#1 DER: what libp2p keeps of an RSA key in an identity file."""
        return self._key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption())

    def __reduce__(self):  # the validator goes to the DHT's process with its key
        return _key_from_der, (self.der(),)


def _key_from_der(der: bytes) -> IdentityKey:
    return IdentityKey(serialization.load_der_private_key(der, password=None))


@dataclass(frozen=True)
class Identity:
    """This peer's libp2p identity, and what signs its records."""
    key: IdentityKey
    path: Optional[Path] = None  # the file it is kept in across restarts (`--identity`), if any

    @classmethod
    def fresh(cls) -> "Identity":
        return cls(IdentityKey(rsa.generate_private_key(public_exponent=65537, key_size=KEY_BITS)))

    @classmethod
    def load(cls, path: Path) -> "Identity":
        """The identity in a libp2p key file (as `--identity` and hivemind's `P2P.generate_identity` write)."""
        try:
            pb = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
            key = serialization.load_der_private_key(pb.data, password=None) if pb.key_type == crypto_pb2.RSA else None
        except OSError as e:
            raise IdentityError(f"--identity {path}: cannot read it ({e.strerror})") from None
        except Exception as e:  # protobuf and cryptography raise several types on garbage
            raise IdentityError(f"--identity {path}: not a libp2p private key file ({type(e).__name__})") from None
        if not isinstance(key, rsa.RSAPrivateKey):
            kind = crypto_pb2.KeyType.Name(pb.key_type) if pb.key_type in crypto_pb2.KeyType.values() else "unknown"
            raise IdentityError(f"--identity {path}: a key of type {kind}; peers sign their records with RSA "
                                f"identities (move the file away and one is made)")
        return cls(IdentityKey(key), Path(path))

    @classmethod
    def at(cls, path: Optional[Path]) -> "Identity":
        """`--identity`'s: loaded where the file exists, made and kept there where it does not, fresh without one."""
        if path is None:
            return cls.fresh()
        if Path(path).exists():
            return cls.load(path)
        made = cls(cls.fresh().key, Path(path))
        try:
            made.write(made.path)
        except OSError as e:
            raise IdentityError(f"--identity {path}: cannot write it ({e.strerror})") from None
        return made

    def write(self, path: Path) -> None:
        """Atomically, readable by its owner only, in the format p2pd reads."""
        pb = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=self.key.der())
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)  # a try that died after its chmod left it read-only
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pb.SerializeToString())
        os.chmod(tmp, 0o400)
        os.replace(tmp, path)

    @contextlib.contextmanager
    def file(self) -> Iterator[str]:
        """A path p2pd can read our key from while it starts: where it is kept, or a private file removed after."""
        if self.path is not None:
            yield str(self.path)
            return
        with tempfile.TemporaryDirectory(prefix="p2pdiloco-id-") as folder:
            key_file = Path(folder) / "identity.key"
            self.write(key_file)
            yield str(key_file)

    def validator(self) -> RSASignatureValidator:
        return RSASignatureValidator(self.key)

    @functools.cached_property
    def subkey(self) -> str:
        """The subkey our records go under: the validator signs whatever is stored under it. A str, as peer ids
        were before: hivemind's storage orders a key's subkeys, and one of another type beside them can make a
        store fail (a str and a bytes subkey of equal expiration time raise TypeError in its heap)."""
        return self.validator().local_public_key.decode()

    @functools.cached_property
    def peer_id(self) -> str:
        return owner_peer(self.subkey)


@functools.lru_cache(maxsize=4096)
def owner_peer(subkey: object) -> Optional[str]:
    """The libp2p peer id whose key signs records under `subkey` (base58), or None: not an owner's subkey."""
    if isinstance(subkey, str):
        subkey = subkey.encode()
    match = _OWNER.match(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        return None
    try:
        public = serialization.load_ssh_public_key(match.group(1))
    except Exception:  # a malformed key: nobody can have signed under it
        return None
    if not isinstance(public, rsa.RSAPublicKey):
        return None
    spki = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=spki).SerializeToString()
    return base58.b58encode(_SHA256_MULTIHASH + hashlib.sha256(encoded).digest()).decode()


def signed_by(subkey: object, peer: object) -> bool:
    """Whether a record stored under `subkey` that names `peer` is that peer's own (the DHT checked the signature)."""
    return isinstance(peer, str) and owner_peer(subkey) == peer
