"""Tiny real gRPC servers on loopback for the security tests: the real Ravn stubs, trivial servicers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.wire.transport import GRPC_OPTIONS


class EchoStage(wgrpc.StageServicer):
    """Echoes every frame back on the same bidirectional stream; ``calls`` counts handler entries."""

    def __init__(self) -> None:
        self.calls = 0

    async def Link(self, request_iterator, context):  # noqa: N802 - gRPC name
        self.calls += 1
        while True:
            frame = await context.read()
            if frame is grpc.aio.EOF:
                return
            await context.write(frame)


class EchoControl(cgrpc.ControlServicer):
    """Unary Probe and server-streaming Join, enough to exercise every call shape we use."""

    def __init__(self) -> None:
        self.calls = 0

    async def Probe(self, request, context):  # noqa: N802
        self.calls += 1
        return cpb.ProbeReply(payload=request.payload[::-1])

    async def Join(self, request, context):  # noqa: N802
        self.calls += 1
        for i in range(3):
            yield cpb.Command(shutdown=cpb.Shutdown(reason=f"{request.peer_id}-{i}"))

    async def UploadState(self, request_iterator, context):  # noqa: N802
        self.calls += 1
        n = 0
        async for _ in request_iterator:
            n += 1
        return cpb.UploadReply(tensors=n)


@contextlib.asynccontextmanager
async def serve(
    *, interceptors: list | None = None, add_port=None, options: list | None = None
) -> AsyncIterator[tuple[str, EchoStage, EchoControl]]:
    """A grpc.aio server with both echo services on 127.0.0.1:<free port>; yields (target, stage, control).

    ``add_port(server, address) -> port`` replaces the insecure port (e.g. for TLS).
    """
    server = grpc.aio.server(interceptors=interceptors, options=options or GRPC_OPTIONS)
    stage, control = EchoStage(), EchoControl()
    wgrpc.add_StageServicer_to_server(stage, server)
    cgrpc.add_ControlServicer_to_server(control, server)
    address = "127.0.0.1:0"
    port = add_port(server, address) if add_port else server.add_insecure_port(address)
    await server.start()
    try:
        yield f"127.0.0.1:{port}", stage, control
    finally:
        await server.stop(grace=None)


async def link_roundtrip(channel: grpc.aio.Channel, n: int = 3, timeout: float = 10.0) -> list[pb.Frame]:
    """Write ``n`` frames on Stage.Link with write()/read() as the daemon does; return what came back."""
    call = wgrpc.StageStub(channel).Link(timeout=timeout)
    got = []
    for i in range(n):
        await call.write(pb.Frame(packet_id=i, data=b"x" * i, last=True, total_size=i))
        got.append(await call.read())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    return got
