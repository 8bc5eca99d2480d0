"""Endpoints are multiaddrs on the wire and in records, gRPC targets ("host:port") in sockets.

One parser for both directions, so a bad address fails early with a message naming what is wrong.
"""

from __future__ import annotations

import ipaddress

from multiaddr import Multiaddr


class EndpointError(ValueError):
    """An address that cannot be used as a peer endpoint."""


def target_to_endpoint(host: str, port: int) -> str:
    """``("127.0.0.1", 5000)`` -> ``/ip4/127.0.0.1/tcp/5000``."""
    if not 0 < port < 65536:
        raise EndpointError(f"port {port} is outside 1..65535")
    try:
        ip = ipaddress.ip_address(host)
        proto = "ip4" if ip.version == 4 else "ip6"
    except ValueError:
        proto = "dns"
    return str(Multiaddr(f"/{proto}/{host}/tcp/{port}"))


def endpoint_to_target(endpoint: str) -> str:
    """``/ip4/1.2.3.4/tcp/5000`` -> ``1.2.3.4:5000`` (``[::1]:5000`` for IPv6)."""
    try:
        ma = Multiaddr(endpoint)
    except Exception as e:  # noqa: BLE001 - multiaddr raises several types for bad input
        raise EndpointError(f"{endpoint!r} is not a valid multiaddr ({e}); expected e.g. /ip4/1.2.3.4/tcp/31337") from e
    host = port = None
    for proto in ("ip4", "ip6", "dns", "dns4", "dns6"):
        try:
            host = ma.value_for_protocol(proto)
        except Exception:  # noqa: BLE001
            host = None
        if host:
            if proto == "ip6":
                host = f"[{host}]"
            break
    try:
        port = ma.value_for_protocol("tcp")
    except Exception:  # noqa: BLE001
        port = None
    if not host or not port:
        raise EndpointError(f"{endpoint!r} needs a host (/ip4, /ip6 or /dns) and a /tcp port")
    return f"{host}:{port}"
