"""The server half of a link: accepts the upstream neighbour's stream and hands it to the daemon.

Every refusal is a gRPC status with a reason a human can act on: a stranger that sends garbage gets
INVALID_ARGUMENT, a peer from another run or protocol FAILED_PRECONDITION, a peer we were not told
about PERMISSION_DENIED. The server keeps serving whatever one stream did.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from swarm.auth import authenticated_peer
from swarm.config import PROTOCOL_VERSION
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.stage_runner import StageInputError
from swarm.transport import Link, LinkClosed, fail_server_stream, read_hello
from swarm.wire import WireError, split_packet

if TYPE_CHECKING:
    from peer.daemon import PeerDaemon

log = logging.getLogger(__name__)


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
        proven = authenticated_peer(context)
        if proven is not None and proven != hello.peer_id:
            await fail_server_stream(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"the call is signed by {proven!r} but its hello claims {hello.peer_id!r}",
            )
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
        from_downstream = bool(a.accept_downstream) and hello.peer_id == a.downstream_peer
        if hello.peer_id != a.upstream_peer and not from_downstream:
            await fail_server_stream(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer {hello.peer_id!r} is not this stage's upstream neighbour {a.upstream_peer!r}"
                + (f" nor its downstream neighbour {a.downstream_peer!r}" if a.accept_downstream else ""),
            )
            return
        link.name = f"{d.peer_id}<-{hello.peer_id}"
        generation = d.generation
        if from_downstream:  # a downstream neighbour behind NAT dialled us
            if d.downstream is not None and not d.downstream.closed.is_set():
                d.downstream.close()
            d.downstream = link
            d.downstream_ready.set()
        else:
            if d.upstream is not None and not d.upstream.closed.is_set():
                d.upstream.close()
            d.upstream = link
        for frame in split_packet(d.hello(), 0):
            await context.write(frame)
        try:
            await link.run(context, d.on_packet)
        except (WireError, StageInputError) as e:
            d.refused += 1
            await fail_server_stream(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LinkClosed as e:
            log.warning("%s", e)
        finally:
            if d.upstream is link:
                d.upstream = None
            if d.downstream is link:
                d.downstream = None
        if from_downstream:  # we wait for this neighbour's gradients: its loss is ours to report
            await d._link_failed(generation, f"downstream peer {hello.peer_id} (behind NAT) closed its link")
