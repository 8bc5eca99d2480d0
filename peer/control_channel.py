"""How a peer reaches the coordinator's Control service: in clear, or over TLS pinned by the signed plan.

The peer reads the plan from the DHT before it ever dials the coordinator, and trusts only plans signed by
the key in its join command. The plan names both where the Control service listens and, when the
coordinator serves TLS, the fingerprint of its certificate; so the pin comes from the same signature as
the address, and a man in the middle needs the coordinator's key, not just a place on the path.

:class:`Channels` makes every channel this peer opens, to the coordinator or to a neighbour's Stage
service, each carrying the peer's proof of swarm membership and pinned where the signed plan pins.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from swarm.dht.multiaddrs import multiaddr_to_grpc_target
from swarm.dht.schema import Plan
from swarm.security import auth, tls
from swarm.wire.transport import GRPC_OPTIONS

log = logging.getLogger(__name__)


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


class Channels:
    """Every channel of one peer: proofs signed with its key for the audience called, pins from the plan."""

    def __init__(self, peer_id: str, swarm_token: str, signing_key, timeout: float) -> None:
        self.peer_id, self.token, self.signing_key, self.timeout = peer_id, swarm_token, signing_key, timeout

    def _interceptors(self, audience: str) -> list | None:
        if not self.token:
            return None
        return auth.client_interceptors(self.token, self.peer_id, audience, signer=self.signing_key)

    async def coordinator(self, address: ControlAddress) -> grpc.aio.Channel:
        """A channel to the coordinator, pinned to the certificate the signed plan names (if any)."""
        return await dial_control(address, self._interceptors(auth.COORDINATOR_AUDIENCE), self.timeout)

    async def stage(self, target: str, peer: str, pin: str) -> grpc.aio.Channel:
        """A channel to ``peer``'s Stage service: TLS pinned to ``pin``, or in clear when the plan gives none."""
        if not pin:
            return grpc.aio.insecure_channel(target, options=GRPC_OPTIONS, interceptors=self._interceptors(peer))
        channel = await tls.dial_pinned(
            target, pin, options=GRPC_OPTIONS, interceptors=self._interceptors(peer), timeout=self.timeout
        )
        log.info("linking to %s over TLS, certificate pinned to %s", peer, pin)
        return channel
