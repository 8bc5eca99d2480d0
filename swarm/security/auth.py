"""Swarm membership proof on every gRPC call: a join token, HMAC-signed metadata, replay protection.

Peers are strangers on the internet and every peer id is public (it is in the plan), so "the Hello
names my upstream neighbour" proves nothing. Every call therefore carries a proof that its sender holds
the swarm's *join token* (a 256-bit secret printed in the join command):

    ravn-peer  = the caller's peer id          ravn-aud   = whom the proof is for (peer id, "coordinator")
    ravn-ts    = unix time in milliseconds     ravn-nonce = 16 random bytes, base64url
    ravn-mac   = base64url(HMAC-SHA256(K, "ravn-auth-v1" | method | aud | peer | ts | nonce))
    ravn-key   = the caller's Ed25519 public key (the key of its DHT record)
    ravn-sig   = its signature of the same fields (:mod:`swarm.security.identity`)

``K`` is derived from the token (never the token itself), so a proof reveals nothing usable about it.
The server checks the fields, the clock window, the MAC (constant time), then the nonce against a
bounded cache: a captured proof cannot be replayed to the same server (nonce), to another method
(method in the MAC), to another server (audience in the MAC) or later (timestamp window).

The token proves membership; the signature tells members apart. A server given the plan's keys
(``Verifier(keys=...)``) refuses a call that names a planned peer but is signed by another key, and
accounts nonces per pinned member (:mod:`swarm.security.nonces`), so one member's proofs never refuse another's.
Handlers that act on a peer named in the request check the caller with :func:`swarm.security.identity.check_caller`.
Without TLS an eavesdropper learns nothing about the token but can read the traffic; an active man in
the middle can hijack an authenticated stream. Use :mod:`swarm.security.tls` against that.

Client side: grpc only attaches call credentials on secure channels, so the proof is added by grpc.aio
client interceptors (:func:`client_interceptors`), which work on insecure and TLS channels alike and
for all four call shapes, including the bidirectional ``Stage.Link`` stream.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.security.identity import META_KEY, META_SIG, CallSigner
from swarm.security.identity import verify as verify_signature
from swarm.security.nonces import DEFAULT_NONCE_CACHE, NonceBook

TOKEN_PREFIX = "ravn1-"
TOKEN_BYTES = 32
DEFAULT_SKEW_S = 300.0  # home PCs' clocks drift; NTP keeps them well inside this
NONCE_BYTES = 16

META_PEER = "ravn-peer"
META_AUDIENCE = "ravn-aud"
META_TS = "ravn-ts"
META_NONCE = "ravn-nonce"
META_MAC = "ravn-mac"
META_KEYS = (META_PEER, META_AUDIENCE, META_TS, META_NONCE, META_MAC, META_KEY, META_SIG)
COORDINATOR_AUDIENCE = "coordinator"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the PeerId pattern of swarm.dht.schema
_B64_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_TS_RE = re.compile(r"^[0-9]{1,15}$")
_MAC_CONTEXT = b"ravn-auth-v1"
_KEY_CONTEXT = b"ravn/grpc-auth/v1 key"
_FINGERPRINT_CONTEXT = b"ravn/grpc-auth/v1 fingerprint"


class AuthError(Exception):
    """A call whose proof is missing or invalid; the text is safe to send back to the caller."""

    code = grpc.StatusCode.UNAUTHENTICATED


class NotThatPeer(AuthError):
    """A valid member's proof that names a planned peer whose key it does not hold."""

    code = grpc.StatusCode.PERMISSION_DENIED


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    if not _B64_RE.fullmatch(text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ---------------------------------------------------------------------------------------------------
# The join token.


def generate_token() -> str:
    """A fresh join token: ``ravn1-`` and 256 random bits in base64url (shell- and URL-safe)."""
    return TOKEN_PREFIX + _b64(secrets.token_bytes(TOKEN_BYTES))


def parse_token(text: str) -> bytes:
    """The secret bytes of a token printed by :func:`generate_token`; ValueError says what is wrong.

    Only generated tokens are accepted: a passphrase chosen by a person would be guessable offline
    from any captured proof.
    """
    if not isinstance(text, str):
        raise ValueError("join token must be a string")
    text = text.strip()
    if not text.startswith(TOKEN_PREFIX):
        raise ValueError(f"join token must start with {TOKEN_PREFIX!r} (copy it from the coordinator's join command)")
    try:
        secret = _unb64(text[len(TOKEN_PREFIX) :])
    except (ValueError, binascii.Error):
        raise ValueError("join token is not valid base64url; was it cut while copying?") from None
    if len(secret) != TOKEN_BYTES:
        raise ValueError(f"join token holds {len(secret)} bytes, expected {TOKEN_BYTES}; was it cut while copying?")
    return secret


@dataclass(frozen=True)
class SwarmKey:
    """The MAC key derived from a join token; ``fingerprint`` names the token in logs without revealing it."""

    key: bytes
    fingerprint: str

    @classmethod
    def from_token(cls, token: str) -> SwarmKey:
        secret = parse_token(token)
        key = hmac.new(secret, _KEY_CONTEXT, hashlib.sha256).digest()
        fp = hmac.new(secret, _FINGERPRINT_CONTEXT, hashlib.sha256).hexdigest()[:12]
        return cls(key=key, fingerprint=fp)

    def mac(self, method: str, audience: str, peer_id: str, ts_ms: int, nonce: str) -> str:
        body = proof_body(method, audience, peer_id, ts_ms, nonce)
        return _b64(hmac.new(self.key, _MAC_CONTEXT + b"\n" + body, hashlib.sha256).digest())

    def __repr__(self) -> str:  # never print the key
        return f"SwarmKey(fingerprint={self.fingerprint!r})"


def proof_body(method: str, audience: str, peer_id: str, ts_ms: int, nonce: str) -> bytes:
    """The fields a proof vouches for: the token's MAC and the caller's signature both cover them."""
    return b"\n".join((method.encode(), audience.encode(), peer_id.encode(), str(ts_ms).encode(), nonce.encode()))


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must be 1-128 characters of [A-Za-z0-9._-], starting alphanumeric")
    return value


def _method_str(method: str | bytes) -> str:
    return method.decode("ascii", "replace") if isinstance(method, bytes) else method


def proof_metadata(
    key: SwarmKey,
    peer_id: str,
    audience: str,
    method: str | bytes,
    *,
    signer: CallSigner,
    now: float | None = None,
    nonce: str | None = None,
) -> tuple[tuple[str, str], ...]:
    """The metadata that proves one call (``method`` is the full gRPC path, ``/pkg.Service/Method``),
    signed with the caller's own key."""
    _check_name("peer id", peer_id)
    _check_name("audience", audience)
    ts_ms = int((time.time() if now is None else now) * 1000)
    nonce = nonce or _b64(secrets.token_bytes(NONCE_BYTES))
    method = _method_str(method)
    mac = key.mac(method, audience, peer_id, ts_ms, nonce)
    return (
        (META_PEER, peer_id),
        (META_AUDIENCE, audience),
        (META_TS, str(ts_ms)),
        (META_NONCE, nonce),
        (META_MAC, mac),
        *signer.metadata(proof_body(method, audience, peer_id, ts_ms, nonce)),
    )


# ---------------------------------------------------------------------------------------------------
# Server side: verification.


def _metadata_dict(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """Our auth keys from call metadata; a key given twice is refused (which one would count?)."""
    found: dict[str, str] = {}
    for item in metadata or ():
        k, v = item[0], item[1]
        if k not in META_KEYS:
            continue
        if k in found:
            raise AuthError(f"auth metadata {k!r} appears more than once")
        if isinstance(v, bytes):
            raise AuthError(f"auth metadata {k!r} must be text")
        found[k] = v
    return found


class Verifier:
    """Checks proofs for one server. ``audiences``: names this server answers to (None: any).

    ``keys``: the public key the current plan pins for a peer id (None: not planned). A call naming a
    planned peer must be signed by that peer's key, and its nonces are accounted to that peer alone.
    """

    def __init__(
        self,
        token: str,
        *,
        audiences: Iterable[str] | None = None,
        keys: Callable[[str], str | None] | None = None,
        skew_s: float = DEFAULT_SKEW_S,
        nonce_capacity: int = DEFAULT_NONCE_CACHE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.key = SwarmKey.from_token(token)
        self.audiences = None if audiences is None else frozenset(_check_name("audience", a) for a in audiences)
        self.keys = keys or (lambda _peer: None)
        self.skew_s = skew_s
        self.clock = clock
        self.nonces = NonceBook(skew_s, nonce_capacity)
        self.refused = 0

    def verify(self, metadata: Iterable[tuple[str, str | bytes]] | None, method: str | bytes) -> str:
        """The caller's peer id if the proof is valid (an identity where the plan pins it); AuthError otherwise."""
        try:
            return self._verify(_metadata_dict(metadata), _method_str(method))
        except AuthError:
            self.refused += 1
            raise

    def _verify(self, meta: dict[str, str], method: str) -> str:
        missing = [k for k in META_KEYS if k not in meta]
        if len(missing) == len(META_KEYS):
            raise AuthError(
                "this swarm requires a join token: the call carried no proof "
                "(start the peer with the --swarm-token from the coordinator's join command)"
            )
        if missing:
            raise AuthError(f"incomplete swarm auth proof: missing {', '.join(missing)}")
        peer, audience, ts_text, nonce, mac, public_key, signature = (meta[k] for k in META_KEYS)
        if not _NAME_RE.fullmatch(peer) or not _NAME_RE.fullmatch(audience):
            raise AuthError("malformed peer id or audience in the auth proof")
        if not _TS_RE.fullmatch(ts_text) or not _B64_RE.fullmatch(nonce) or not 16 <= len(nonce) <= 64:
            raise AuthError("malformed timestamp or nonce in the auth proof")
        if not _B64_RE.fullmatch(mac) or len(mac) != 43:
            raise AuthError("malformed MAC in the auth proof")
        now = self.clock()
        ts_ms = int(ts_text)
        offset = ts_ms / 1000.0 - now
        if abs(offset) > self.skew_s:
            raise AuthError(
                f"stale proof: its timestamp is {offset:+.0f} s from this server's clock "
                f"(allowed +-{self.skew_s:.0f} s); check both clocks (NTP)"
            )
        if not hmac.compare_digest(self.key.mac(method, audience, peer, ts_ms, nonce), mac):
            raise AuthError(
                "invalid swarm auth proof: wrong join token (this server's token is "
                f"{self.key.fingerprint}) or a forged or altered call"
            )
        if self.audiences is not None and audience not in self.audiences:
            raise AuthError(f"proof is addressed to {audience!r}, not to this server")
        try:
            verify_signature(public_key, signature, proof_body(method, audience, peer, ts_ms, nonce))
        except ValueError as e:
            raise AuthError(str(e)) from None
        pinned = self.keys(peer)
        if pinned is not None and pinned != public_key:
            raise NotThatPeer(f"the call claims peer {peer!r} but is not signed by the key that peer announced")
        reason = self.nonces.add(f"{peer} {public_key}" if pinned else None, nonce, ts_ms, now)
        if reason is not None:
            raise AuthError(reason)
        return peer


def peer_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The ``ravn-peer`` value of call metadata. Verified only when the server runs :class:`ServerAuth`,
    and an identity only where the plan pins that peer's key (see :func:`swarm.security.identity.check_caller`)."""
    for item in metadata or ():
        if item[0] == META_PEER and isinstance(item[1], str):
            return item[1]
    return None


def authenticated_peer(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's peer id as its proof states it (meaningful only behind :class:`ServerAuth`)."""
    return peer_from_metadata(context.invocation_metadata())


def deny_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with ``code`` without reading it.

    Requests are left as raw bytes (no deserializer): a refused caller's payload is never parsed.
    """

    async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, response_serializer=handler.response_serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny, response_serializer=handler.response_serializer)


class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid proof with UNAUTHENTICATED; the handler never runs.

    Install it first: ``grpc.aio.server(interceptors=[ServerAuth(verifier), ...])``. ``exempt`` names
    full method paths served without proof (none by default).
    """

    def __init__(self, verifier: Verifier, *, exempt: Iterable[str] = ()) -> None:
        self.verifier = verifier
        self.exempt = frozenset(exempt)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in self.exempt:
            return handler
        try:
            self.verifier.verify(handler_call_details.invocation_metadata, handler_call_details.method)
        except AuthError as e:
            return deny_handler(handler, e.code, str(e))
        return handler


# ---------------------------------------------------------------------------------------------------
# Client side.


class ClientAuth:
    """Makes a fresh proof for every call of one channel: one instance per (token, own id, server).

    Use :meth:`interceptors` (or :func:`client_interceptors`):
    ``grpc.aio.insecure_channel(target, interceptors=ClientAuth(token, "peer-1", "peer-2").interceptors())``.
    grpc.aio files each interceptor object under the *first* call shape it implements (an if/elif on
    the four ABCs), so one object implementing all four would only ever see unary-unary calls; hence
    four small objects. The stream-stream calls they return keep ``write``/``read``/``done_writing``.
    """

    def __init__(
        self,
        token: str | SwarmKey,
        peer_id: str,
        audience: str,
        clock: Callable[[], float] = time.time,
        *,
        signer: Ed25519PrivateKey,
    ) -> None:
        self.key = token if isinstance(token, SwarmKey) else SwarmKey.from_token(token)
        self.peer_id = _check_name("peer id", peer_id)
        self.audience = _check_name("audience", audience)
        self.clock = clock
        self.signer = CallSigner(signer)

    def proof(self, method: str | bytes) -> tuple[tuple[str, str], ...]:
        return proof_metadata(self.key, self.peer_id, self.audience, method, signer=self.signer, now=self.clock())

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        """``details`` with this call's proof in its metadata (any stale proof keys replaced)."""
        proof = self.proof(details.method)
        kept = [(k, v) for k, v in (details.metadata or ()) if k not in META_KEYS]
        return details._replace(metadata=grpc.aio.Metadata(*kept, *proof))

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [_UnaryUnary(self), _UnaryStream(self), _StreamUnary(self), _StreamStream(self)]


def client_interceptors(
    token: str | SwarmKey,
    peer_id: str,
    audience: str,
    clock: Callable[[], float] = time.time,
    *,
    signer: Ed25519PrivateKey,
) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add a proof, signed with ``signer`` (the peer's record key), to every call to ``audience``."""
    return ClientAuth(token, peer_id, audience, clock, signer=signer).interceptors()


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, prover: ClientAuth) -> None:
        self.prover = prover

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self.prover.details(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, prover: ClientAuth) -> None:
        self.prover = prover

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self.prover.details(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, prover: ClientAuth) -> None:
        self.prover = prover

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self.prover.details(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, prover: ClientAuth) -> None:
        self.prover = prover

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self.prover.details(client_call_details), request_iterator)


class SyncClientAuth(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """The same proof for the synchronous API (``ravn status``): ``grpc.intercept_channel(ch, it)``.

    Unlike grpc.aio, the synchronous API offers every call shape to every interceptor, so one object
    serves them all.
    """

    def __init__(self, prover: ClientAuth) -> None:
        self.prover = prover

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        proof = self.prover.proof(details.method)
        kept = [(k, v) for k, v in (details.metadata or ()) if k not in META_KEYS]
        return _SyncCallDetails(
            details.method,
            details.timeout,
            (*kept, *proof),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _SyncCallDetails(
    collections.namedtuple(
        "_SyncCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    """grpc.ClientCallDetails is an empty ABC; the synchronous API reads these six fields."""


def sync_channel(channel: grpc.Channel, token: str | SwarmKey, peer_id: str, audience: str) -> grpc.Channel:
    """``channel`` (synchronous API) with a fresh proof on every call, signed with a throwaway key.

    Its user (``ravn status``) is no member: no plan pins its key, so it is served only by calls that
    name no peer (Status)."""
    prover = ClientAuth(token, peer_id, audience, signer=Ed25519PrivateKey.generate())
    return grpc.intercept_channel(channel, SyncClientAuth(prover))


def load_or_create_token(path: Path) -> str:
    """The swarm's token kept in ``path`` (mode 0600), so a restarted coordinator keeps its swarm."""
    path = path.expanduser()
    if path.exists():
        if path.stat().st_mode & 0o077:
            raise ValueError(f"{path} is readable by other users; chmod 600 it")
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = generate_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
