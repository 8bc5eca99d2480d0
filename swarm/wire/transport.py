"""Links between neighbouring stages: packets both ways over one bidirectional gRPC stream.

Whichever side can dial opens the stream (a peer behind NAT dials out); after that the two ends are
symmetric: each writes frames from its outgoing queue and reads frames into packets that it hands to
a callback in arrival order. The transport knows packets, frames and limits, never transformers.
A packet the callback rejects (``WireError``) ends the stream with INVALID_ARGUMENT and the reason,
on the server side as a gRPC status, on the dialling side as a Refusal packet followed by a cancel.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from swarm.pb import wire_pb2 as pb
from swarm.wire.packets import MAX_FRAME_BYTES, Reassembler, WireError, split_packet

log = logging.getLogger(__name__)

MAX_GRPC_MESSAGE = 4 << 20
MAX_HELLO_BYTES = 4096
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
]


class FrameStream(Protocol):
    """What both a server context and a client call offer for a bidi stream."""

    async def read(self) -> object: ...
    async def write(self, message: pb.Frame) -> None: ...


PacketHandler = Callable[["Link", pb.Packet], Awaitable[None]]


class LinkClosed(ConnectionError):
    """The neighbour went away or refused us; ``reason`` says why."""


class Link:
    """One neighbour connection. ``send`` queues a packet; incoming packets go to ``handler``."""

    _ids = itertools.count(1)

    def __init__(self, name: str, *, max_queue: int = 64, max_packet_bytes: int | None = None) -> None:
        self.name = name
        self.remote: pb.Hello | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.closed = asyncio.Event()
        self.error: str | None = None
        self._out: asyncio.Queue[pb.Packet | None] = asyncio.Queue(maxsize=max_queue)
        self._reasm = Reassembler() if max_packet_bytes is None else Reassembler(max_packet_bytes=max_packet_bytes)
        self._packet_ids = itertools.count(1)

    def bound_packets(self, max_bytes: int) -> None:
        """From now on refuse packets over ``max_bytes`` at their first frame (what this stage's block needs)."""
        self._reasm.max_packet_bytes = max_bytes

    async def send(self, packet: pb.Packet) -> None:
        """Queue ``packet``; waits when the queue is full (backpressure), fails once the link is closed."""
        if self.closed.is_set():
            raise LinkClosed(f"link {self.name} is closed: {self.error or 'closed'}")
        await self._out.put(packet)

    def close(self) -> None:
        """Finish sending what is queued, then end the stream."""
        try:
            self._out.put_nowait(None)
        except asyncio.QueueFull:
            pass

    async def _write_loop(self, stream: FrameStream) -> None:
        while True:
            packet = await self._out.get()
            if packet is None:
                return
            for frame in split_packet(packet, next(self._packet_ids), MAX_FRAME_BYTES):
                await stream.write(frame)
                self.bytes_sent += frame.ByteSize()

    async def _read_one(self, stream: FrameStream) -> pb.Packet | None:
        while True:
            try:
                frame = await stream.read()
            except DecodeError as e:  # a message that is not even a Frame
                raise WireError(f"undecodable frame: {e}") from None
            if frame is grpc.aio.EOF or frame is None:
                return None
            self.bytes_received += frame.ByteSize()
            packet = self._reasm.push(frame)
            if packet is not None:
                return packet

    async def run(self, stream: FrameStream, handler: PacketHandler, *, first: pb.Packet | None = None) -> None:
        """Pump both directions until either ends; raises WireError for bad input from the other side."""
        writer = asyncio.create_task(self._write_loop(stream), name=f"{self.name}-write")
        try:
            if first is not None:
                await handler(self, first)
            while True:
                reader = asyncio.ensure_future(self._read_one(stream))
                done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
                if writer in done and reader not in done:
                    reader.cancel()
                    writer.result()
                    return
                packet = reader.result()
                if packet is None:
                    return
                if packet.WhichOneof("body") == "refusal":
                    raise LinkClosed(
                        f"{self.name}: the other side refused micro-batch "
                        f"{packet.refusal.mb_id}: {packet.refusal.reason[:200]!r}"
                    )
                await handler(self, packet)
        finally:
            writer.cancel()
            self.closed.set()


def hello_packet(peer_id: str, stage: int, run_id: str, protocol_version: int) -> pb.Packet:
    return pb.Packet(hello=pb.Hello(peer_id=peer_id, stage=stage, run_id=run_id, protocol_version=protocol_version))


async def read_hello(stream: FrameStream, link: Link, timeout: float) -> pb.Hello:
    """The first packet of every link must be a Hello; anything else is a protocol error.

    Until the sender is known, a packet may be at most ``MAX_HELLO_BYTES``: a stranger cannot make us buffer.
    """
    normal, link._reasm = link._reasm, Reassembler(max_packet_bytes=MAX_HELLO_BYTES)
    try:
        packet = await asyncio.wait_for(link._read_one(stream), timeout)
    finally:
        link._reasm = normal
    if packet is None:
        raise LinkClosed(f"{link.name}: stream ended before the hello")
    if packet.WhichOneof("body") != "hello":
        raise WireError(f"expected a hello as the first packet, got {packet.WhichOneof('body')}")
    link.remote = packet.hello
    return packet.hello


async def fail_server_stream(context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str) -> None:
    """End a server-side stream with a status the dialler can read."""
    log.warning("refusing stream: %s", reason)
    await context.abort(code, reason)


async def refuse_client_stream(call: grpc.aio.StreamStreamCall, link: Link, reason: str, mb_id: int = 0) -> None:
    """Tell the server why we hang up, then cancel the call."""
    try:
        for frame in split_packet(pb.Packet(refusal=pb.Refusal(mb_id=mb_id, reason=reason)), 0):
            await asyncio.wait_for(call.write(frame), 2.0)
    except Exception:  # noqa: BLE001 - best effort: the stream may already be gone
        pass
    call.cancel()
