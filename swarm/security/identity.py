"""The peer id of a call as an identity: each call is signed with the caller's own Ed25519 key.

The join token proves membership; it cannot tell members apart, because every member holds it. So
every call also carries the caller's public key (``ravn-key``) and a signature with it (``ravn-sig``)
over the same fields the token's MAC covers (method, audience, peer id, timestamp, nonce). The key is
the one the peer signs its DHT record with (:mod:`swarm.dht.signing`): the coordinator pins it at
join and copies it into the signed plan, so every member can look up the key of every other member.

:class:`swarm.security.auth.ServerAuth` checks the signature (possession of the key) and refuses a call that
names a planned peer but is signed by another key. Handlers whose request names a peer then call
:func:`check_caller` against the key the current plan gives that peer: only its holder passes.
Callers outside the plan (``ravn status``, a peer measuring its link before it is planned) sign with
keys nobody pinned; their calls are served only where no peer is named.
"""

from __future__ import annotations

import base64
import binascii
import re

import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from swarm.dht.schema import Plan

META_KEY = "ravn-key"
META_SIG = "ravn-sig"
_PEER = "ravn-peer"  # swarm.security.auth.META_PEER (auth imports this module)
_CONTEXT = b"ravn-call-v1\n"  # never mistaken for a record or plan signature
_KEY_RE = re.compile(r"^[A-Za-z0-9+/]{43}=$")
_SIG_RE = re.compile(r"^[A-Za-z0-9+/]{86}==$")


class IdentityError(Exception):
    """The caller is not the peer its request names (or not the holder of that peer's key)."""


def public_key_text(key: Ed25519PrivateKey) -> str:
    """The base64 public key, as peer records and plans carry it."""
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode("ascii")


class CallSigner:
    """Signs proofs with one process's key (the key of its DHT record)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key = public_key_text(key)

    def metadata(self, proof_body: bytes) -> tuple[tuple[str, str], tuple[str, str]]:
        signature = base64.b64encode(self._key.sign(_CONTEXT + proof_body)).decode("ascii")
        return (META_KEY, self.public_key), (META_SIG, signature)

    def __repr__(self) -> str:  # never print the key
        return f"CallSigner(public_key={self.public_key!r})"


def verify(public_key: str, signature: str, proof_body: bytes) -> None:
    """ValueError unless ``signature`` is ``public_key``'s signature of this proof."""
    if not _KEY_RE.fullmatch(public_key) or not _SIG_RE.fullmatch(signature):
        raise ValueError("malformed call key or signature")
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key, validate=True))
        key.verify(base64.b64decode(signature, validate=True), _CONTEXT + proof_body)
    except (InvalidSignature, ValueError, binascii.Error):
        raise ValueError("the call's signature does not verify with the key it names") from None


def _meta(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for item in context.invocation_metadata() or ():
        if item[0] == name and isinstance(item[1], str):
            return item[1]
    return None


def caller_key(context: grpc.aio.ServicerContext) -> str | None:
    """The key the call is signed with (verified when the server runs :class:`swarm.security.auth.ServerAuth`)."""
    return _meta(context, META_KEY)


def check_caller(context: grpc.aio.ServicerContext, claimed: str, pinned: str | None) -> None:
    """IdentityError unless the call was made by ``claimed``: its proof names it and is signed by ``pinned``.

    Only meaningful behind ServerAuth, which has verified the proof and its signature."""
    proven = _meta(context, _PEER)
    if proven != claimed:
        raise IdentityError(f"the call is made by {proven!r} but names peer {claimed!r}")
    if pinned is None:
        raise IdentityError(f"peer {claimed!r} is not in the current plan: no key is known for it")
    if caller_key(context) != pinned:
        raise IdentityError(f"the call names peer {claimed!r} but is not signed by that peer's key")


def plan_keys(plan: Plan | None) -> dict[str, str]:
    """Peer id -> public key, as the signed plan gives them (peers without a key are left out)."""
    if plan is None:
        return {}
    return {p.peer_id: p.public_key for st in plan.stages for p in st.peers if p.public_key}
