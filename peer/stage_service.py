"""The server half of a link: accepts the upstream neighbour's stream and hands it to the daemon.

Every refusal is a gRPC status with a reason a human can act on: a stranger that sends garbage gets
INVALID_ARGUMENT, a peer from another run or protocol FAILED_PRECONDITION, a peer we were not told
about PERMISSION_DENIED, and so does a token holder that names a neighbour whose key it does not hold
(swarm/identity.py). The server keeps serving whatever one stream did.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

import grpc

from peer.averaging import AverageRefused
from swarm.config import PROTOCOL_VERSION
from swarm.identity import IdentityError, check_caller
from swarm.messages import assignment_neighbours as neighbours
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.stage_runner import StageInputError
from swarm.transport import Link, LinkClosed, fail_server_stream, read_hello
from swarm.wire import WireError, split_packet

if TYPE_CHECKING:
    from peer.daemon import PeerDaemon

log = logging.getLogger(__name__)


def impostor(daemon: PeerDaemon, context: grpc.aio.ServicerContext, claimed: str) -> str | None:
    """Why the caller is not ``claimed`` (None: it is, or the swarm is open and nobody is authenticated)."""
    if not daemon.settings.swarm_token:
        return None
    try:
        check_caller(context, claimed, daemon.peer_key(claimed))
    except IdentityError as e:
        return str(e)
    return None


class StageService(wgrpc.StageServicer):
    def __init__(self, daemon: PeerDaemon) -> None:
        self.daemon = daemon

    async def Link(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802 - gRPC name
        d = self.daemon
        link = Link(f"{d.peer_id}<-?")
        try:
            hello = await read_hello(context, link, d.settings.link_timeout)
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
        try:  # the neighbour may have heard of the plan a moment before we did
            await asyncio.wait_for(d.assigned.wait(), d.settings.link_timeout)
        except TimeoutError:
            await fail_server_stream(context, grpc.StatusCode.UNAVAILABLE, "this peer has no block assigned yet")
            return
        a = d.assignment
        if hello.run_id != a.run_id:
            await fail_server_stream(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {hello.run_id!r} is not this peer's run {a.run_id!r}",
            )
            return
        ups, downs, _ = neighbours(a)
        from_downstream = bool(a.accept_downstream) and hello.peer_id in downs
        if hello.peer_id not in ups and not from_downstream:
            await fail_server_stream(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer {hello.peer_id!r} is not an upstream neighbour of this stage "
                f"({', '.join(sorted(ups)) or 'none'})"
                + (f" nor a downstream one ({', '.join(sorted(downs))})" if a.accept_downstream else ""),
            )
            return
        refusal = impostor(d, context, hello.peer_id)  # the plan names the neighbour; its key says who calls
        if refusal is not None:
            await fail_server_stream(context, grpc.StatusCode.PERMISSION_DENIED, refusal)
            return
        link.name = f"{d.peer_id}<-{hello.peer_id}"
        link.bound_packets(d.bounds.max_packet_bytes)
        link.remote = hello
        generation = d.generation
        side = "downstream" if from_downstream else "upstream"
        d.attach(side, hello.peer_id, link)
        for frame in split_packet(d.hello(), 0):
            await context.write(frame)
        # a downstream neighbour behind NAT: we wait for its gradients, so losing it is ours to report;
        # an upstream one: a lone upstream's loss is reported by whoever sees its process die
        closed = functools.partial(
            d.link_closed,
            generation,
            side,
            hello.peer_id,
            link,
            f"{side} peer {hello.peer_id} closed its link",
            report=from_downstream,
        )
        try:
            await link.run(context, d.on_packet)
        except (WireError, StageInputError) as e:
            d.refused += 1
            await fail_server_stream(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LinkClosed as e:
            log.warning("%s", e)
        except Exception:  # a bug, not bad input: say so loudly; the link ends and recovery takes over
            log.exception("link from %s failed", hello.peer_id)
        finally:
            # also when gRPC cancels this handler (the neighbour died): the bookkeeping of a vanished replica
            # (its share of open steps) must finish, or this stage waits for a step that never completes
            await asyncio.shield(closed())

    async def Average(self, request, context: grpc.aio.ServicerContext):  # noqa: N802 - gRPC name
        """A replica of our block sends its parameter change; answer with the round's agreed average."""
        d = self.daemon
        sender = request.peer_id
        refusal = impostor(d, context, sender)  # the group then checks it is a replica of this block
        if refusal is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        group = d.group
        if group is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this peer holds no replicated block")
        try:
            return await group.collect(request, sender)
        except AverageRefused as e:
            await context.abort(e.code, str(e))
