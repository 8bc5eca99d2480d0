"""Peer records signed by the peer's own Ed25519 key, and the coordinator's pins of those keys.

Anyone who can reach the DHT can store a value under ``ravn/<swarm>/peers``: without signatures a
stranger could announce a record in a live peer's name (another endpoint, state ``leaving``) and the
coordinator would re-plan around it. Each peer therefore makes a key pair when it starts, puts the
public key in its record and signs the record (canonical JSON, with a domain-separation prefix) after
the DHT timestamp is set. The coordinator (:class:`KeyPins`) accepts a record only if its signature
verifies, and pins the first key it sees for a peer id for as long as that peer keeps announcing: a
record for the same id under another key is ignored while the pinned one is alive, so only the holder
of the key can speak for a live peer. Once the pinned key has been silent for ``ttl`` (its record has
expired: the peer is gone), a new key may take the name, so a restarted peer can come back.

What this does not give: identity across restarts (the key is per process), or protection against a
record being displaced in the DHT (hivemind keeps the value with the latest expiry per subkey; the
coordinator ignores the forged one, but the honest record is back only at its next heartbeat).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from swarm.dht.schema import PeerRecord

CONTEXT = b"ravn/peer-record/v1\n"  # a record signature can never be mistaken for any other signature


class RecordSignatureError(ValueError):
    """A peer record that is unsigned, badly signed, or signed by a key other than the pinned one."""


def new_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_key_text(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def signed_bytes(record: PeerRecord) -> bytes:
    """What the signature covers: every field but the signature, as canonical JSON."""
    body = record.model_dump(mode="json", exclude={"signature"})
    return CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign_record(record: PeerRecord, key: Ed25519PrivateKey) -> PeerRecord:
    """``record`` with this key's public key and a signature over everything else."""
    unsigned = record.model_copy(update={"public_key": public_key_text(key), "signature": ""})
    signature = base64.b64encode(key.sign(signed_bytes(unsigned))).decode("ascii")
    return PeerRecord.model_validate({**unsigned.to_dht_value(), "signature": signature})


def verify_record(record: PeerRecord) -> None:
    """RecordSignatureError unless ``record`` carries a valid signature by the key it names."""
    if not record.public_key or not record.signature:
        raise RecordSignatureError(f"peer record {record.peer_id!r} is not signed")
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(record.public_key, validate=True))
        key.verify(base64.b64decode(record.signature, validate=True), signed_bytes(record))
    except (InvalidSignature, ValueError) as e:
        raise RecordSignatureError(f"peer record {record.peer_id!r} has an invalid signature") from e


class KeyPins:
    """Trust on first use, per peer id, for as long as the pinned key keeps announcing (see module doc)."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._pins: dict[str, tuple[str, float]] = {}  # peer id -> (public key, last seen)

    def check(self, record: PeerRecord) -> None:
        """Accept ``record`` (refreshing its pin) or raise RecordSignatureError saying why not."""
        verify_record(record)
        now = self.clock()
        pinned = self._pins.get(record.peer_id)
        if pinned is not None and pinned[0] != record.public_key and now - pinned[1] < self.ttl:
            raise RecordSignatureError(
                f"peer record {record.peer_id!r} is signed by another key than the live peer of that name"
            )
        self._pins[record.peer_id] = (record.public_key, now)
