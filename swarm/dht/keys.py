"""The coordinator's RSA key pair: made once, kept in a 0600 PEM file, pinned by peers as one token.

The key is the coordinator's identity in a swarm: it signs the plan (``swarm.dht.records``), and its
public half travels in join commands, usually by copy-paste, so parsing gives readable reasons and
fingerprints read like ``ssh-keygen -lf``. It is hivemind's RSA key type, because hivemind's
``RSASignatureValidator`` makes the DHT itself sign and check values under the subkey the key owns
(:func:`plan_subkey`).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import tempfile
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

logger = logging.getLogger(__name__)

MIN_RSA_BITS = 2048
MAX_PUBLIC_KEY_CHARS = 4096


def generate_private_key() -> RSAPrivateKey:
    """A fresh 2048-bit RSA key for a coordinator (hivemind's key type, so the DHT can sign with it)."""
    return RSAPrivateKey()


def _public_of(key: RSAPrivateKey | RSAPublicKey) -> RSAPublicKey:
    return key.get_public_key() if isinstance(key, RSAPrivateKey) else key


def export_public_key(key: RSAPrivateKey | RSAPublicKey) -> str:
    """The public key as one shell-safe token (the base64 of its OpenSSH encoding), for join commands."""
    _algorithm, blob = _public_of(key).to_bytes().split()[:2]
    return blob.decode("ascii")


def load_public_key(text: str) -> RSAPublicKey:
    """Parse a key printed by :func:`export_public_key` (or a full ``ssh-rsa AAAA... [comment]`` line).

    Raises ValueError with a readable reason: the key typically arrives by copy-paste from a chat.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("coordinator public key is empty")
    if len(text) > MAX_PUBLIC_KEY_CHARS:
        raise ValueError(f"coordinator public key is {len(text)} characters long; expected well under 1000")
    parts = text.split()
    if parts[0] == "ssh-rsa" and len(parts) >= 2:
        blob = parts[1]
    elif len(parts) == 1:
        blob = parts[0]
    else:
        raise ValueError(f"coordinator public key {text[:40]!r}... is neither a base64 key nor 'ssh-rsa <base64>'")
    try:
        key = serialization.load_ssh_public_key(b"ssh-rsa " + blob.encode("ascii"))
    except (ValueError, UnsupportedAlgorithm, UnicodeEncodeError) as e:
        raise ValueError(f"coordinator public key {blob[:24]!r}... does not parse as an RSA key: {e}") from e
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("coordinator public key is not an RSA key")
    if key.key_size < MIN_RSA_BITS:
        raise ValueError(f"coordinator public key has {key.key_size} bits; at least {MIN_RSA_BITS} are required")
    return RSAPublicKey(key)


def public_key_fingerprint(key: RSAPrivateKey | RSAPublicKey) -> str:
    """``SHA256:...`` fingerprint, the same as ``ssh-keygen -lf`` prints: short enough to compare by eye."""
    blob = base64.b64decode(export_public_key(key))
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii").rstrip("=")


def plan_subkey(key: RSAPrivateKey | RSAPublicKey) -> bytes:
    """The subkey of ``ravn/<swarm>/plan`` owned by ``key``: ``[owner:ssh-rsa ...]``.

    The marker is what makes hivemind's RSASignatureValidator demand a signature by this key.
    """
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", _public_of(key).to_bytes())


def save_private_key(key: RSAPrivateKey, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``key`` as an unencrypted PKCS#8 PEM file readable by its owner only (mode 0600).

    The file is created with 0600 from the start (never briefly world-readable); with ``overwrite`` it
    is written to a temporary file and renamed into place, so a crash never leaves half a key.
    """
    path = Path(path)
    pem = serialization.load_der_private_key(key.to_bytes(), password=None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    if not overwrite:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return path
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_private_key(path: str | os.PathLike[str]) -> RSAPrivateKey:
    """Read a PEM key written by :func:`save_private_key`; refuse files others can read, like ssh does."""
    path = Path(path)
    mode = path.stat().st_mode
    if os.name == "posix" and mode & 0o077:
        raise PermissionError(
            f"coordinator key {path} is accessible by group/others (mode {oct(mode & 0o777)}); run: chmod 600 {path}"
        )
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{path} does not hold an RSA private key")
    if key.key_size < MIN_RSA_BITS:
        raise ValueError(f"{path} holds a {key.key_size}-bit key; at least {MIN_RSA_BITS} bits are required")
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    # hivemind's RSAPrivateKey() always generates a new key; its __setstate__ (meant for unpickling, no
    # pickle involved here) is the one public way to build one around existing key material.
    loaded = RSAPrivateKey.__new__(RSAPrivateKey)
    loaded.__setstate__({"_private_key": der})
    return loaded


def load_or_create_private_key(path: str | os.PathLike[str]) -> RSAPrivateKey:
    """The coordinator's identity: load it from ``path``, or create and save it on first start."""
    path = Path(path)
    if path.exists():
        return load_private_key(path)
    key = generate_private_key()
    save_private_key(key, path)
    logger.info("created coordinator key %s (%s)", path, public_key_fingerprint(key))
    return key
