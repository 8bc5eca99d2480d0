"""Optional TLS for Ravn's gRPC links, with self-signed certificates pinned by fingerprint.

Home peers have no domain names and no CA will sign for ``/ip4/203.0.113.7``, so each peer may make
its own certificate (:func:`generate_self_signed`) and publish its SHA-256 fingerprint where dialers
already look (its DHT record, the signed plan, the coordinator's join command). A dialer then trusts
exactly that certificate: grpc-python has no verify callback, so :func:`fetch_certificate` reads the
certificate the server presents in a plain TLS handshake, :func:`check_fingerprint` compares it with
the pin, and the channel uses that very certificate as its only root (``root_certificates``) with
``grpc.ssl_target_name_override`` set to the name inside it. If the server presents anything else in
the gRPC handshake, the chain check fails: only a holder of the pinned certificate's private key can
complete it. Operators with a real certificate pass ``--tls-cert/--tls-key`` instead
(:func:`load_identity`); pinning works the same way for those.

TLS protects what the join token (:mod:`swarm.security.auth`) cannot: confidentiality of activations and
gradients, and streams that a man in the middle cannot take over after the proof was checked.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

DEFAULT_SERVER_NAME = "ravn-peer.invalid"  # .invalid never resolves: the name only has to match the pin
CERT_DAYS = 3650
MAX_CERT_PEM_BYTES = 64 * 1024
_FP_RE = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")


class TlsError(ValueError):
    """A certificate that cannot be used or does not match its pin; the text says which."""


@dataclass(frozen=True)
class TlsIdentity:
    """A server's certificate chain and private key (PEM) and the fingerprint dialers pin."""

    cert_pem: bytes
    key_pem: bytes
    fingerprint: str

    def __repr__(self) -> str:  # keep the private key out of logs and tracebacks
        return f"TlsIdentity(fingerprint={self.fingerprint!r})"


def fingerprint(cert_pem_or_der: bytes) -> str:
    """``sha256:<64 hex>`` of the DER certificate; the same as ``openssl x509 -fingerprint -sha256``."""
    return "sha256:" + hashlib.sha256(_der(cert_pem_or_der)).hexdigest()


def normalise_fingerprint(text: str) -> str:
    """Accept ``sha256:ab12...``, bare hex, or OpenSSL's ``AB:12:...`` form; TlsError otherwise."""
    cleaned = text.strip().lower().replace("sha256 fingerprint=", "")
    if cleaned.startswith("sha256:"):
        cleaned = cleaned[len("sha256:") :]
    cleaned = cleaned.replace(":", "")
    m = _FP_RE.fullmatch(cleaned)
    if not m:
        raise TlsError(f"certificate fingerprint {text[:80]!r} is not 64 hex digits of SHA-256")
    return "sha256:" + m.group(1)


def _der(cert: bytes) -> bytes:
    if cert.lstrip().startswith(b"-----BEGIN"):
        return _load_pem_cert(cert).public_bytes(serialization.Encoding.DER)
    return cert


def _load_pem_cert(pem: bytes) -> x509.Certificate:
    if len(pem) > MAX_CERT_PEM_BYTES:
        raise TlsError(f"certificate of {len(pem)} bytes is larger than {MAX_CERT_PEM_BYTES}")
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise TlsError(f"not a PEM certificate: {e}") from None


def generate_self_signed(common_name: str = DEFAULT_SERVER_NAME, days: int = CERT_DAYS) -> TlsIdentity:
    """A fresh P-256 key and a self-signed certificate for ``common_name`` (also its only DNS name).

    P-256 keeps the handshake cheap on every peer; the certificate is its own CA (``CA:TRUE``) so that
    TLS libraries accept it as the single trust anchor of a pinned channel.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return TlsIdentity(cert_pem=cert_pem, key_pem=key_pem, fingerprint=fingerprint(cert_pem))


def load_identity(cert_path: Path, key_path: Path) -> TlsIdentity:
    """Read ``--tls-cert`` / ``--tls-key`` (PEM); checks that the key belongs to the certificate."""
    try:
        cert_pem, key_pem = Path(cert_path).read_bytes(), Path(key_path).read_bytes()
    except OSError as e:
        raise TlsError(f"cannot read the TLS certificate or key: {e}") from None
    cert = _load_pem_cert(cert_pem)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise TlsError(f"{key_path} is not an unencrypted PEM private key: {e}") from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, spki) != cert.public_key().public_bytes(
        serialization.Encoding.DER, spki
    ):
        raise TlsError(f"the key in {key_path} does not belong to the certificate in {cert_path}")
    return TlsIdentity(cert_pem=cert_pem, key_pem=key_pem, fingerprint=fingerprint(cert_pem))


def save_identity(identity: TlsIdentity, cert_path: Path, key_path: Path) -> None:
    """Write a generated identity so a restarted peer keeps its fingerprint (key file mode 0600)."""
    key_path = Path(key_path)
    key_path.parent.mkdir(parents=True, exist_ok=True)
    key_path.touch(mode=0o600, exist_ok=True)
    key_path.chmod(0o600)
    key_path.write_bytes(identity.key_pem)
    Path(cert_path).write_bytes(identity.cert_pem)


def load_or_create_identity(cert_path: Path, key_path: Path) -> TlsIdentity:
    """The identity in these files, or a new self-signed one saved there (for a stable fingerprint)."""
    if Path(cert_path).exists() or Path(key_path).exists():
        return load_identity(cert_path, key_path)
    identity = generate_self_signed()
    save_identity(identity, cert_path, key_path)
    return identity


def identity_from_options(
    mode: str, cert: Path | None, key: Path | None, *, keep_in: tuple[Path, Path] | None = None
) -> TlsIdentity | None:
    """The server identity that ``--tls``/``--tls-cert``/``--tls-key`` ask for, shared by both daemons.

    ``mode`` is ``off`` or ``self-signed``; a given certificate wins. ``keep_in`` (certificate, key paths)
    makes a self-signed identity persistent, so a restarted server keeps the fingerprint its clients pin;
    without it every process gets a fresh one. TlsError says what is wrong with the options.
    """
    if (cert is None) != (key is None):
        raise TlsError("pass both --tls-cert and --tls-key")
    if cert is not None:
        return load_identity(cert, key)
    if mode == "self-signed":
        return load_or_create_identity(*keep_in) if keep_in is not None else generate_self_signed()
    if mode != "off":
        raise TlsError(f"--tls {mode[:40]!r}: use 'off' or 'self-signed'")
    return None


def server_credentials(identity: TlsIdentity) -> grpc.ServerCredentials:
    """Credentials for ``server.add_secure_port``; no client certificates are asked for."""
    return grpc.ssl_server_credentials([(identity.key_pem, identity.cert_pem)])


def add_port(server: grpc.aio.Server, address: str, identity: TlsIdentity | None) -> int:
    """Listen on ``address`` with TLS when an identity is given, in clear otherwise; the bound port."""
    if identity is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(identity))


def server_name(cert_pem: bytes) -> str:
    """The name gRPC must check the certificate against: its first DNS name, else its common name."""
    cert = _load_pem_cert(cert_pem)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
    except x509.ExtensionNotFound:
        names = []
    if names:
        return names[0]
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if cns and isinstance(cns[0].value, str):
        return cns[0].value
    raise TlsError("certificate has neither a DNS name nor a common name to check it against")


def check_fingerprint(cert_pem: bytes, expected: str) -> None:
    """TlsError unless the certificate's fingerprint is the pinned one."""
    got, want = fingerprint(cert_pem), normalise_fingerprint(expected)
    if got != want:
        raise TlsError(
            f"the server presented certificate {got}, but {want} was expected: "
            "wrong address, a restarted peer with a new certificate, or someone in between"
        )


def pinned_channel(
    target: str,
    cert_pem: bytes,
    expected: str,
    *,
    options: list[tuple[str, object]] | None = None,
    interceptors: list | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel that trusts only ``cert_pem``, which must have the fingerprint ``expected``."""
    credentials, opts = _pinned_credentials(cert_pem, expected, options)
    return grpc.aio.secure_channel(target, credentials, options=opts, interceptors=interceptors)


def _pinned_credentials(
    cert_pem: bytes, expected: str, options: list[tuple[str, object]] | None
) -> tuple[grpc.ChannelCredentials, list[tuple[str, object]]]:
    check_fingerprint(cert_pem, expected)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
    return credentials, [*(options or []), ("grpc.ssl_target_name_override", server_name(cert_pem))]


def _split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise TlsError(f"gRPC target {target!r} is not host:port")
    return host.strip("[]"), int(port)


async def fetch_certificate(target: str, timeout: float = 10.0) -> bytes:
    """The certificate (PEM) a TLS server at ``host:port`` presents, read without trusting it.

    Verification is off on purpose: what is checked is the fingerprint, by the caller.
    """
    host, port = _split_target(target)
    try:
        _reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=_unverified_context(), server_hostname=DEFAULT_SERVER_NAME),
            timeout,
        )
    except (OSError, ssl.SSLError, TimeoutError) as e:
        raise TlsError(f"TLS handshake with {target} failed: {e}") from None
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.transport.abort()  # no graceful TLS shutdown: gRPC servers do not answer close_notify
    if not der:
        raise TlsError(f"{target} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode("ascii")


def _unverified_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def fetch_certificate_sync(target: str, timeout: float = 10.0) -> bytes:
    """:func:`fetch_certificate` for synchronous callers (``ravn status``), which have no event loop."""
    host, port = _split_target(target)
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            _unverified_context().wrap_socket(raw, server_hostname=DEFAULT_SERVER_NAME) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError) as e:
        raise TlsError(f"TLS handshake with {target} failed: {e}") from None
    if not der:
        raise TlsError(f"{target} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode("ascii")


def dial_pinned_sync(
    target: str, expected: str, *, options: list[tuple[str, object]] | None = None, timeout: float = 10.0
) -> grpc.Channel:
    """:func:`dial_pinned` for the synchronous gRPC API: a channel that trusts only the pinned certificate."""
    credentials, opts = _pinned_credentials(fetch_certificate_sync(target, timeout), expected, options)
    return grpc.secure_channel(target, credentials, options=opts)


def speaks_tls(target: str, timeout: float = 5.0) -> bool:
    """Does the server at ``target`` complete a TLS handshake? Lets a cleartext client say why it failed."""
    try:
        fetch_certificate_sync(target, timeout)
    except TlsError:
        return False
    return True


async def dial_pinned(
    target: str,
    expected: str,
    *,
    options: list[tuple[str, object]] | None = None,
    interceptors: list | None = None,
    timeout: float = 10.0,
) -> grpc.aio.Channel:
    """Fetch the server's certificate, check it against the pin, return a channel trusting only it."""
    cert_pem = await fetch_certificate(target, timeout)
    return pinned_channel(target, cert_pem, expected, options=options, interceptors=interceptors)
