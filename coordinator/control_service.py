"""The coordinator's gRPC face: peers join, report, and upload their blocks here.

It only translates between the wire and the run, which it reaches through ``ControlHandlers`` (the few
calls it needs, handed to it at construction; it never sees the run itself); every bad request
gets a gRPC status naming what to fix (wrong protocol version, bad endpoint, duplicate name). A call that
names a peer is served only to that peer, and an upload only for its own block at an expected version
(coordinator/call_checks.py); Status, DialBack and Probe name no peer and serve any token holder.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from coordinator.call_checks import CallRefused, caller_is, upload_allowed
from coordinator.checkpoint_store import StaleCheckpoint
from coordinator.sessions import PeerSession
from swarm.config import PROTOCOL_VERSION
from swarm.dht.multiaddrs import EndpointError, multiaddr_to_grpc_target
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.resume import ATTACHED_KEY, ResumeClaim
from swarm.security.auth import authenticated_peer
from swarm.wire.packets import Reassembler, WireError, split_packet, tensor_to_pb
from swarm.wire.state_checks import BlockSpec, decode_state
from swarm.wire.transport import GRPC_OPTIONS

log = logging.getLogger(__name__)
MAX_PROBE_BYTES = 2 << 20
DIAL_BACK_TIMEOUT = 3.0


def caller_host(peer: str) -> str:
    """gRPC's ``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` -> the host part."""
    _, _, rest = peer.partition(":")
    return rest.rsplit(":", 1)[0].strip("[]")


async def dial_back(target: str, timeout: float = DIAL_BACK_TIMEOUT) -> tuple[bool, str]:
    """Can a stranger open a connection to ``target``? (What a neighbour would have to do.)"""
    async with grpc.aio.insecure_channel(target, options=GRPC_OPTIONS) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
            return True, f"connected to {target}"
        except TimeoutError:
            return False, f"no connection to {target} within {timeout:.0f} s (inbound connections blocked?)"


Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ControlHandlers:
    """What the Control service may ask of the run: nothing else is within its reach."""

    swarm_token: str  # empty: no caller identity checks (tests only)
    peer_key: Callable[[str], str | None]  # the key the plan pins for a peer
    register: Callable[[cpb.JoinRequest, ResumeClaim | None], PeerSession]  # PermissionError / ValueError
    lost: Callable[[str, str, PeerSession], None]  # a peer's control stream ended
    known: Callable[[str], bool]  # has this peer joined?
    on_report: Callable[[cpb.StatusReport], None]
    held_block: Callable[[str], tuple[int, int, int] | None]  # (stage, layer_start, layer_end) in the plan
    checkpoint_window: Callable[[], tuple[int, int]]  # the versions a periodic checkpoint may carry now
    upload_limit: Callable[[], int]  # bytes of the largest planned block's state
    upload_spec: Callable[[cpb.StateChunk], BlockSpec]  # what an upload of this block must contain
    on_checkpoint: Callable[[cpb.StateChunk, Tensors, Tensors], None]  # on a worker thread; StaleCheckpoint
    on_state: Callable[[str, int, Tensors], None]  # a peer's final block
    fetch_state: Callable[[int, list[str]], tuple[Tensors, Tensors]]  # KeyError: no such checkpoint
    status: Callable[[], dict]  # the status snapshot as JSON-ready data


class ControlService(cgrpc.ControlServicer):
    def __init__(self, handlers: ControlHandlers) -> None:
        self.handlers = handlers

    async def Join(self, request: cpb.JoinRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer speaks protocol version {request.protocol_version}, this coordinator speaks "
                f"{PROTOCOL_VERSION}; install a matching ravn-swarm release",
            )
        try:
            multiaddr_to_grpc_target(request.endpoint)
        except EndpointError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not request.peer_id or len(request.peer_id) > 128:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "peer_id must be 1..128 characters")
        await self._caller_is(context, request.peer_id)
        try:
            claim = ResumeClaim.from_metadata(context.invocation_metadata())
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            session = self.handlers.register(request, claim)
        except PermissionError as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        # tells a re-attaching peer at once that it is back in (an adopted peer may get no command for long)
        await context.send_initial_metadata(((ATTACHED_KEY, "adopted" if session.adopted else "assigned"),))
        try:
            while True:
                command = await session.commands.get()
                if command is None:
                    return
                yield command
        except asyncio.CancelledError:
            self.handlers.lost(session.peer_id, "its control stream was cancelled", session)
            raise

    async def _caller_is(self, context: grpc.aio.ServicerContext, peer_id: str) -> None:
        try:
            caller_is(self.handlers.swarm_token, self.handlers.peer_key, context, peer_id)
        except CallRefused as e:
            await context.abort(e.code, str(e))

    async def Report(self, request: cpb.StatusReport, context: grpc.aio.ServicerContext) -> cpb.ReportReply:  # noqa: N802
        await self._caller_is(context, request.peer_id)
        if not self.handlers.known(request.peer_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"peer {request.peer_id!r} has not joined this run")
        self.handlers.on_report(request)
        return cpb.ReportReply()

    async def UploadState(self, request_iterator, context: grpc.aio.ServicerContext) -> cpb.UploadReply:  # noqa: N802
        await self._caller_is(context, authenticated_peer(context) or "")  # a member's own, before reading it
        handlers = self.handlers
        limit = handlers.upload_limit()  # the largest planned block
        reasm = Reassembler(max_packet_bytes=limit, message_type=cpb.StateChunk)
        chunk = None
        try:
            async for frame in request_iterator:
                chunk = reasm.push(frame)
            if chunk is None:
                raise WireError("upload ended before its last frame")
            await self._caller_is(context, chunk.peer_id)
            if not self.handlers.known(chunk.peer_id):
                await context.abort(grpc.StatusCode.NOT_FOUND, f"peer {chunk.peer_id!r} has not joined this run")
            try:
                upload_allowed(handlers.held_block(chunk.peer_id), chunk, handlers.checkpoint_window())
            except CallRefused as e:
                await context.abort(e.code, str(e))
            spec = handlers.upload_spec(chunk)
            tensors, optim = await asyncio.to_thread(decode_state, chunk, spec)
        except WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if chunk.periodic:
            try:
                await asyncio.to_thread(self.handlers.on_checkpoint, chunk, tensors, optim)
            except StaleCheckpoint as e:  # trained under a plan the run has left (a recovery re-planned)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        else:
            self.handlers.on_state(chunk.peer_id, chunk.stage, tensors)
        return cpb.UploadReply(tensors=len(tensors))

    async def FetchState(self, request: cpb.FetchStateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await self._caller_is(context, request.peer_id)
        if not self.handlers.known(request.peer_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"peer {request.peer_id!r} has not joined this run")
        try:
            weights, optim = await asyncio.to_thread(self.handlers.fetch_state, request.version, list(request.names))
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        chunk = cpb.StateChunk(peer_id=request.peer_id, version=request.version)
        for name, t in weights.items():
            chunk.tensors.add(name=name, tensor=tensor_to_pb(t, "fp32" if t.is_floating_point() else "raw"))
        for name, t in optim.items():
            chunk.optimizer.add(name=name, tensor=tensor_to_pb(t, "fp32"))
        for frame in split_packet(chunk, 1):
            yield frame

    async def DialBack(self, request: cpb.DialBackRequest, context: grpc.aio.ServicerContext) -> cpb.DialBackReply:  # noqa: N802
        try:
            target = multiaddr_to_grpc_target(request.endpoint)
        except EndpointError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        host = target.rsplit(":", 1)[0].strip("[]")
        caller = caller_host(context.peer())
        if host != caller:  # never a port scanner for strangers: only the caller's own address
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"can only dial back the caller's own address {caller}, not {host}"
            )
        reachable, detail = await dial_back(target)
        return cpb.DialBackReply(reachable=reachable, detail=detail)

    async def Status(self, request: cpb.StatusRequest, context: grpc.aio.ServicerContext) -> cpb.StatusReply:  # noqa: N802
        return cpb.StatusReply(status_json=json.dumps(self.handlers.status(), allow_nan=False))

    async def Probe(self, request: cpb.ProbeRequest, context: grpc.aio.ServicerContext) -> cpb.ProbeReply:  # noqa: N802
        if request.reply_bytes > MAX_PROBE_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"probes are limited to {MAX_PROBE_BYTES} bytes")
        return cpb.ProbeReply(payload=bytes(request.reply_bytes))
