"""A Stage's links to the holders of the neighbouring blocks: who is linked on which side, and dialling.

One bidirectional ``Stage.Link`` stream per neighbour pair carries both directions; it was either
dialled by this peer (:func:`dial`) or accepted by the Stage service. Either way it lands here, and a
newer link to the same peer replaces the older one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.train.stage_runner import StageInputError
from swarm.wire.packets import WireError, split_packet
from swarm.wire.transport import Link, LinkClosed, read_hello, refuse_client_stream

log = logging.getLogger(__name__)
UPSTREAM, DOWNSTREAM = "upstream", "downstream"


class Links:
    """The open links of one Stage, by side and peer id."""

    def __init__(self, downstreams: set[str]) -> None:
        self.upstreams: dict[str, Link] = {}  # every holder of the previous block, by peer id
        self.downstreams: dict[str, Link] = {}  # every holder of the next block
        self.expected_downstreams = set(downstreams)
        self.downstream_ready = asyncio.Event()  # every holder of the next block is linked

    def table(self, side: str) -> dict[str, Link]:
        return self.downstreams if side == DOWNSTREAM else self.upstreams

    def all(self) -> list[Link]:
        return [*self.upstreams.values(), *self.downstreams.values()]

    def attach(self, side: str, peer: str, link: Link) -> None:
        """A link is up (dialled by us or accepted): it replaces any older one to that peer."""
        table = self.table(side)
        old = table.get(peer)
        if old is not None and old is not link and not old.closed.is_set():
            old.close()
        table[peer] = link
        if side == DOWNSTREAM and self.expected_downstreams <= set(self.downstreams):
            self.downstream_ready.set()

    def detach(self, side: str, peer: str, link: Link) -> bool:
        """``link`` ended; True when no newer link to that peer replaced it (the peer is really gone)."""
        table = self.table(side)
        if table.get(peer) is link:
            del table[peer]
        return table.get(peer) is None

    def is_from(self, side: str, peer: str, link: Link) -> bool:
        return self.table(side).get(peer) is link

    def close(self) -> None:
        for link in self.all():
            link.close()

    def bytes(self) -> tuple[int, int]:
        links = self.all()
        return sum(lk.bytes_sent for lk in links), sum(lk.bytes_received for lk in links)


async def dial(
    channel: grpc.aio.Channel,
    target: str,
    name: str,
    side: str,
    peer: str,
    hello: pb.Packet,
    *,
    timeout: float,
    max_packet_bytes: int,
    attach: Callable[[Link], bool],
    on_packet: Callable[[Link, pb.Packet], Awaitable[None]],
    on_refused: Callable[[], None],
) -> tuple[Link, str]:
    """Open and serve one link to ``peer``; returns it and why it ended ("": never attached, not wanted).
    ``attach`` returns False when the link is no longer wanted (its Stage was closed meanwhile)."""
    link = Link(name)
    call = wgrpc.StageStub(channel).Link()
    try:
        for frame in split_packet(hello, 0):
            await call.write(frame)
        reply = await read_hello(call, link, timeout)
        if reply.peer_id != peer:
            raise WireError(f"expected {side} peer {peer}, reached {reply.peer_id}")
        if not attach(link):
            call.cancel()
            return link, ""
        link.bound_packets(max_packet_bytes)
        await link.run(call, on_packet)
        return link, f"{side} peer {peer} closed the link"
    except (WireError, StageInputError) as e:
        on_refused()
        await refuse_client_stream(call, link, str(e))
        return link, f"refused a packet from {side} {peer}: {e}"
    except (TimeoutError, grpc.aio.AioRpcError, LinkClosed) as e:
        detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
        return link, f"link to {side} {peer} at {target} failed: {detail}"
    except Exception as e:  # noqa: BLE001 - a bug, not bad input: say so loudly, and let the coordinator recover
        log.exception("link to %s %s failed", side, peer)
        return link, f"link to {side} {peer} failed: {e!r}"
