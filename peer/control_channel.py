"""How a peer reaches the coordinator's Control service: in clear, or over TLS pinned by the signed plan.

The peer reads the plan from the DHT before it ever dials the coordinator, and trusts only plans signed by
the key in its join command. The plan names both where the Control service listens and, when the
coordinator serves TLS, the fingerprint of its certificate; so the pin comes from the same signature as
the address, and a man in the middle needs the coordinator's key, not just a place on the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from swarm import tls
from swarm.dht_schema import Plan
from swarm.multiaddrs import multiaddr_to_grpc_target
from swarm.transport import GRPC_OPTIONS


@dataclass(frozen=True)
class ControlAddress:
    """The coordinator's Control endpoint (``host:port``) and the certificate it must present ("" in clear)."""

    target: str
    pin: str = ""

    @classmethod
    def of(cls, plan: Plan) -> ControlAddress:
        return cls(multiaddr_to_grpc_target(plan.coordinator), plan.coordinator_tls_fingerprint)

    def __str__(self) -> str:  # log lines name the endpoint, as before TLS
        return self.target


async def dial_control(address: ControlAddress, interceptors: list | None, timeout: float) -> grpc.aio.Channel:
    """A channel to ``address``: pinned TLS when it has a pin (TlsError if the server presents another
    certificate or cannot be reached), else cleartext (which connects lazily, on the first call)."""
    if not address.pin:
        return grpc.aio.insecure_channel(address.target, options=GRPC_OPTIONS, interceptors=interceptors)
    return await tls.dial_pinned(
        address.target, address.pin, options=GRPC_OPTIONS, interceptors=interceptors, timeout=timeout
    )


def failure_detail(error: grpc.aio.AioRpcError | tls.TlsError) -> str:
    """One line on why a call to the coordinator failed, whichever layer refused it."""
    return error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
