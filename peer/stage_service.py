"""The server half of a link: the gRPC Stage servicer, an adapter over the current :class:`peer.stage.Stage`.

It accepts a neighbour's stream, checks who calls, and hands the link to the Stage; it owns no state and
changes none but the Stage's, through the Stage's own methods. What it may ask of the peer is the narrow
:class:`StageHost` given at construction.

Every refusal is a gRPC status with a reason a human can act on: a stranger that sends garbage gets
INVALID_ARGUMENT, a peer from another run or protocol FAILED_PRECONDITION, a peer we were not told
about PERMISSION_DENIED, and so does a token holder that names a neighbour whose key it does not hold
(swarm/security/identity.py). The server keeps serving whatever one stream did.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from peer.replicas.averaging import AverageRefused
from peer.stage import Stage
from swarm.config import PROTOCOL_VERSION
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.security.identity import IdentityError, check_caller
from swarm.train.stage_runner import StageInputError
from swarm.wire.packets import WireError, split_packet
from swarm.wire.transport import Link, LinkClosed, fail_server_stream, read_hello

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageHost:
    """What the Stage service may ask of the peer that serves it."""

    peer_id: str
    swarm_token: str  # "" : an open swarm, nobody is authenticated (tests only)
    link_timeout: float
    peer_key: Callable[[str], str | None]  # the key the signed plan pins for a peer (None: not in the plan)
    stage: Callable[[float], Awaitable[Stage | None]]  # the current Stage, waiting up to that long for one
    current: Callable[[], Stage | None]  # the current Stage now, if any


def impostor(host: StageHost, context: grpc.aio.ServicerContext, claimed: str) -> str | None:
    """Why the caller is not ``claimed`` (None: it is, or the swarm is open and nobody is authenticated)."""
    if not host.swarm_token:
        return None
    try:
        check_caller(context, claimed, host.peer_key(claimed))
    except IdentityError as e:
        return str(e)
    return None


class StageService(wgrpc.StageServicer):
    def __init__(self, host: StageHost) -> None:
        self.host = host

    async def Link(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802 - gRPC name
        host = self.host
        link = Link(f"{host.peer_id}<-?")
        try:
            hello = await read_hello(context, link, host.link_timeout)
        except WireError as e:
            await fail_server_stream(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        except (LinkClosed, TimeoutError):
            return
        if hello.protocol_version != PROTOCOL_VERSION:
            await fail_server_stream(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {hello.protocol_version} is not supported; this peer speaks {PROTOCOL_VERSION}",
            )
            return
        stage = await host.stage(host.link_timeout)  # the neighbour may have heard of the plan a moment before us
        if stage is None:
            await fail_server_stream(context, grpc.StatusCode.UNAVAILABLE, "this peer has no block assigned yet")
            return
        a, view = stage.assignment, stage.view
        if hello.run_id != a.run_id:
            await fail_server_stream(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {hello.run_id!r} is not this peer's run {a.run_id!r}",
            )
            return
        side = stage.accepts(hello.peer_id)
        if side is None:
            await fail_server_stream(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer {hello.peer_id!r} is not an upstream neighbour of this stage "
                f"({', '.join(sorted(view.upstreams)) or 'none'})"
                + (f" nor a downstream one ({', '.join(sorted(view.downstreams))})" if view.accept_downstream else ""),
            )
            return
        from_downstream = side == "downstream"
        refusal = impostor(host, context, hello.peer_id)  # the plan names the neighbour; its key says who calls
        if refusal is not None:
            await fail_server_stream(context, grpc.StatusCode.PERMISSION_DENIED, refusal)
            return
        link.name = f"{host.peer_id}<-{hello.peer_id}"
        link.bound_packets(stage.bounds.max_packet_bytes)
        link.remote = hello
        if not stage.attach(side, hello.peer_id, link):
            await fail_server_stream(context, grpc.StatusCode.UNAVAILABLE, "this peer was re-assigned meanwhile")
            return
        for frame in split_packet(stage.hello(), 0):
            await context.write(frame)
        # a downstream neighbour behind NAT: we wait for its gradients, so losing it is ours to report;
        # an upstream one: a lone upstream's loss is reported by whoever sees its process die
        reason = f"{side} peer {hello.peer_id} closed its link"
        try:
            await link.run(context, stage.on_packet)
        except (WireError, StageInputError) as e:
            stage.count_refused()
            await fail_server_stream(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LinkClosed as e:
            log.warning("%s", e)
        except Exception:  # a bug, not bad input: say so loudly; the link ends and recovery takes over
            log.exception("link from %s failed", hello.peer_id)
        finally:
            # also when gRPC cancels this handler (the neighbour died): the bookkeeping of a vanished replica
            # (its share of open steps) must finish, or this stage waits for a step that never completes
            await asyncio.shield(stage.link_closed(side, hello.peer_id, link, reason, report=from_downstream))

    async def Average(self, request, context: grpc.aio.ServicerContext):  # noqa: N802 - gRPC name
        """A replica of our block sends its parameter change; answer with the round's agreed average."""
        sender = request.peer_id
        refusal = impostor(self.host, context, sender)  # the group then checks it is a replica of this block
        if refusal is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        stage = self.host.current()
        group = stage.replicas.group if stage is not None else None
        if group is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this peer holds no replicated block")
        try:
            return await group.collect(request, sender)
        except AverageRefused as e:
            await context.abort(e.code, str(e))
