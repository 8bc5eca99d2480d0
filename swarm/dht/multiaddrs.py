"""gRPC endpoints as multiaddrs: parse, validate, and convert to and from gRPC targets.

Peers advertise their Stage service in the DHT as a multiaddr (``/ip4/203.0.113.7/tcp/31337``) because
that is the address language of the DHT itself, and it says explicitly which transport is meant. gRPC,
however, dials ``host:port``. Only the shapes gRPC can dial directly are accepted: one host part
(``ip4``, ``ip6``, ``dns``, ``dns4`` or ``dns6``) followed by ``tcp``, nothing before or after. The
addresses come from strangers over the DHT, so every error names the offending address and says why.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrLibraryError

MAX_MULTIADDR_LEN = 256
HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


class EndpointError(ValueError):
    """A multiaddr or gRPC target that cannot be used as a Stage endpoint."""


@dataclass(frozen=True)
class Endpoint:
    """A dialable TCP endpoint: which host protocol, the host itself, and the port."""

    protocol: str  # one of HOST_PROTOCOLS
    host: str
    port: int

    @property
    def multiaddr(self) -> str:
        return f"/{self.protocol}/{self.host}/tcp/{self.port}"

    @property
    def grpc_target(self) -> str:
        # gRPC needs brackets around IPv6 literals, as in URLs.
        return f"[{self.host}]:{self.port}" if self.protocol == "ip6" else f"{self.host}:{self.port}"


def parse_endpoint(maddr: str) -> Endpoint:
    """Parse and validate a Stage endpoint multiaddr such as ``/ip4/1.2.3.4/tcp/31337``.

    Rejects (with :class:`EndpointError`) anything gRPC cannot dial as-is: other transports (udp,
    quic), extra components (``/p2p/...``, ``/tls``), port 0, unspecified or multicast IPs (a peer
    that announces ``0.0.0.0`` has announced its bind address, not where to reach it) and
    non-ASCII host names.
    """
    if not isinstance(maddr, str):
        raise EndpointError(f"endpoint must be a multiaddr string, got {type(maddr).__name__}")
    if len(maddr) > MAX_MULTIADDR_LEN:
        raise EndpointError(f"endpoint multiaddr is {len(maddr)} characters long, the limit is {MAX_MULTIADDR_LEN}")
    if not maddr.startswith("/"):
        raise EndpointError(f"endpoint {maddr!r} is not a multiaddr (expected e.g. /ip4/203.0.113.7/tcp/31337)")
    try:
        parts = list(Multiaddr(maddr).items())
    except (MultiaddrLibraryError, ValueError) as e:
        raise EndpointError(f"endpoint {maddr!r} is not a valid multiaddr: {e}") from e
    names = [proto.name for proto, _ in parts]
    if len(parts) != 2 or names[0] not in HOST_PROTOCOLS or names[1] != "tcp":
        raise EndpointError(
            f"endpoint {maddr!r} has the shape /{'/'.join(names) or '(empty)'}; expected exactly "
            f"/<{'|'.join(HOST_PROTOCOLS)}>/HOST/tcp/PORT (gRPC dials plain TCP, nothing more)"
        )
    host_proto, host, port_str = names[0], parts[0][1], parts[1][1]
    port = int(port_str)
    if not 1 <= port <= 65535:
        raise EndpointError(f"endpoint {maddr!r} has port {port}; a dialable port is 1..65535")
    if host_proto in ("ip4", "ip6"):
        ip = ipaddress.ip_address(host)
        if ip.is_unspecified or ip.is_multicast:
            raise EndpointError(
                f"endpoint {maddr!r} uses the {'unspecified' if ip.is_unspecified else 'multicast'} "
                f"address {ip}; announce the address other peers can dial, not the bind address"
            )
        host = str(ip)  # canonical form (compressed IPv6)
    elif not host.isascii():
        raise EndpointError(f"endpoint {maddr!r} has a non-ASCII host name; use its punycode (xn--) form")
    return Endpoint(protocol=host_proto, host=host, port=port)


def canonical_endpoint(maddr: str) -> str:
    """Validate ``maddr`` and return its canonical spelling (so equal endpoints compare equal)."""
    return parse_endpoint(maddr).multiaddr


def multiaddr_to_grpc_target(maddr: str) -> str:
    """``/ip4/1.2.3.4/tcp/5`` -> ``1.2.3.4:5``; ``/ip6/::1/tcp/5`` -> ``[::1]:5``; ``/dns/h/tcp/5`` -> ``h:5``."""
    return parse_endpoint(maddr).grpc_target


def grpc_target_to_multiaddr(target: str) -> str:
    """Inverse of :func:`multiaddr_to_grpc_target`: ``host:port`` or ``[v6]:port`` -> multiaddr.

    IP literals map to ``/ip4`` or ``/ip6``, anything else to ``/dns`` (resolved to either family). The
    result goes through :func:`parse_endpoint`, so the same rules apply in both directions.
    """
    if not isinstance(target, str) or not target:
        raise EndpointError(f"gRPC target must be a non-empty 'host:port' string, got {target!r}")
    if target.startswith("["):
        host, sep, port_str = target[1:].partition("]:")
        if not sep:
            raise EndpointError(f"gRPC target {target!r} looks like IPv6 but is not '[address]:port'")
    else:
        host, sep, port_str = target.rpartition(":")
        if not sep or not host:
            raise EndpointError(f"gRPC target {target!r} is not 'host:port'")
        if ":" in host:
            raise EndpointError(f"gRPC target {target!r}: IPv6 addresses must be bracketed, as in '[::1]:port'")
    if not port_str.isdigit():
        raise EndpointError(f"gRPC target {target!r} has a non-numeric port {port_str!r}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        protocol = "dns"
    else:
        protocol = "ip4" if ip.version == 4 else "ip6"
    if protocol != "ip6" and target.startswith("["):
        raise EndpointError(f"gRPC target {target!r}: only IPv6 addresses go in brackets")
    return canonical_endpoint(f"/{protocol}/{host}/tcp/{int(port_str)}")
