"""Parameter averaging among the replicas of one block (DiLoCo-style outer steps over our gRPC).

Why not hivemind's ``DecentralizedAverager``: it runs in its own process with shared-memory tensors and
its own compression set, while Ravn's replicas already hold an authenticated gRPC server each, and must
average with Ravn's codecs and count every byte. With the few replicas a block has, a leader (the
replica with the smallest id) is as good as a butterfly all-reduce and far simpler to make safe:

- every replica sends the leader its change since the last agreed parameters (int8 by default);
- the leader waits for every present replica, or ``average_timeout`` after the first contribution,
  averages what arrived, encodes the result **once**, and answers every contributor with the same bytes;
- everyone (leader included) applies those bytes to the same anchor, so the anchors agree exactly.

A replica that dies mid-round is left out after the timeout and not waited for in later rounds until it
contributes again; a leader that dies makes the others' calls fail, and they apply nothing (their
change stays in their next contribution): never a hang, never a half-applied average.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import torch

from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.wire import WireError, tensor_from_pb, tensor_to_pb

log = logging.getLogger(__name__)
KEEP_RESULTS = 16  # closed rounds whose result a late replica can still fetch


class AverageRefused(Exception):
    """The leader will not take this contribution; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass
class _Round:
    number: int
    deadline: float
    deltas: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: pb.AverageReply | None = None
    closing: bool = False


def encode_deltas(deltas: dict[str, torch.Tensor], codec: str) -> list[pb.Delta]:
    return [pb.Delta(name=name, tensor=tensor_to_pb(t.float().contiguous(), codec)) for name, t in deltas.items()]


def decode_deltas(items, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for d in items:
        if names is not None and d.name not in names:
            raise WireError(f"parameter {d.name!r} is not part of this block")
        if d.name in out:
            raise WireError(f"parameter {d.name!r} twice in one contribution")
        t = tensor_from_pb(d.tensor)
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise WireError(f"change of {d.name} is not a finite floating-point tensor")
        out[d.name] = t.float()
    return out


class AverageGroup:
    """One replica's side of its block's averaging: contributor always, leader when it has the smallest id."""

    def __init__(
        self,
        me: str,
        members: dict[str, str],
        *,
        run_id: str,
        layers: tuple[int, int],
        shapes: dict[str, tuple[int, ...]],
        codec: str,
        timeout: float,
        channel: Callable[[str, str], Awaitable[grpc.aio.Channel]],  # target, peer id -> a (pinned) channel
        generation: int = 0,
    ) -> None:
        self.me, self.run_id, self.layers, self.codec, self.timeout = me, run_id, layers, codec, timeout
        self.shapes = shapes
        self.generation = generation
        self._channel = channel
        self.members: dict[str, str] = dict(members)
        self.absent: set[str] = set()
        self._rounds: dict[int, _Round] = {}
        self._results: OrderedDict[int, pb.AverageReply] = OrderedDict()
        self.bytes = 0
        self.rounds_applied = 0
        self.late = 0

    @property
    def leader(self) -> str:
        return min(self.members)

    def set_members(self, members: dict[str, str]) -> None:
        """The plan changed (a replica left or joined): the smallest live id leads from now on."""
        self.members = dict(members)
        self.absent &= set(members)
        for rnd in self._rounds.values():  # a round waiting for a peer that is gone may close now
            self._maybe_close(rnd)

    # ---- contributor ----------------------------------------------------------------------------
    async def contribute(self, round_: int, delta: dict[str, torch.Tensor]) -> tuple[dict, list[str]] | None:
        """Send this replica's change for ``round_``; the agreed average change, or None (apply nothing)."""
        items = await asyncio.to_thread(encode_deltas, delta, self.codec)
        request = pb.AverageRequest(
            run_id=self.run_id,
            round=round_,
            layer_start=self.layers[0],
            layer_end=self.layers[1],
            deltas=items,
            generation=self.generation,
            peer_id=self.me,
        )
        leader = self.leader
        try:
            if leader == self.me:
                reply = await self.collect(request, self.me)
            else:
                self.bytes += request.ByteSize()
                ch = await self._channel(self.members[leader], leader)
                try:
                    reply = await wgrpc.StageStub(ch).Average(request, timeout=self.timeout + 30.0)
                finally:
                    await ch.close()
                self.bytes += reply.ByteSize()
            average = await asyncio.to_thread(decode_deltas, reply.deltas, set(self.shapes))
        except (grpc.aio.AioRpcError, AverageRefused, WireError, TimeoutError, OSError, ValueError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.warning(
                "average round %d with leader %s failed (%s); keeping the change for the next", round_, leader, detail
            )
            return None
        if set(average) != set(self.shapes):
            log.warning("average round %d misses parameters; not applied", round_)
            return None
        if self.me not in reply.contributors:
            self.late += 1
        return average, list(reply.contributors)

    # ---- leader ---------------------------------------------------------------------------------
    async def collect(self, request: pb.AverageRequest, sender: str) -> pb.AverageReply:
        """Take one contribution (the leader's own included) and answer with the round's average."""
        if self.leader != self.me:
            raise AverageRefused(grpc.StatusCode.FAILED_PRECONDITION, f"{self.me} does not lead this group")
        if sender not in self.members:
            raise AverageRefused(grpc.StatusCode.PERMISSION_DENIED, f"{sender!r} is not a replica of this block")
        if request.run_id != self.run_id or (request.layer_start, request.layer_end) != self.layers:
            raise AverageRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"contribution for run {request.run_id!r} layers [{request.layer_start},{request.layer_end}) "
                f"does not match this group's {self.run_id!r} {list(self.layers)}",
            )
        if request.round in self._results:  # closed without this sender: it adopts the agreed result
            return self._results[request.round]
        if self._results and request.round < min(self._results):
            raise AverageRefused(grpc.StatusCode.FAILED_PRECONDITION, f"round {request.round} is too old")
        try:
            deltas = await asyncio.to_thread(decode_deltas, request.deltas, set(self.shapes))
        except WireError as e:
            raise AverageRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        for name, t in deltas.items():
            if tuple(t.shape) != self.shapes[name]:
                raise AverageRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"change of {name} has shape {list(t.shape)}, not {self.shapes[name]}",
                )
        if set(deltas) != set(self.shapes):
            raise AverageRefused(grpc.StatusCode.INVALID_ARGUMENT, "a contribution must cover every parameter")
        if sender != self.me:
            self.bytes += request.ByteSize()
            self.absent.discard(sender)
        rnd = self._rounds.get(request.round)
        if rnd is None:
            rnd = self._rounds[request.round] = _Round(request.round, deadline=time.monotonic() + self.timeout)
        rnd.deltas[sender] = deltas
        self._maybe_close(rnd)
        if not rnd.done.is_set():
            try:
                await asyncio.wait_for(rnd.done.wait(), max(0.0, rnd.deadline - time.monotonic()))
            except TimeoutError:
                pass
        if not rnd.done.is_set():
            await self._close(rnd)
        reply = rnd.result
        if sender != self.me:
            self.bytes += reply.ByteSize()
        return reply

    def _maybe_close(self, rnd: _Round) -> None:
        expected = set(self.members) - self.absent
        if not rnd.done.is_set() and expected <= set(rnd.deltas):
            asyncio.ensure_future(self._close(rnd))

    async def _close(self, rnd: _Round) -> None:
        if rnd.closing:
            await rnd.done.wait()
            return
        rnd.closing = True
        contributors = sorted(rnd.deltas)
        missing = set(self.members) - set(contributors)
        if missing:
            log.warning(
                "average round %d closed without %s (timeout); not waiting for them again",
                rnd.number,
                ", ".join(sorted(missing)),
            )
        self.absent |= missing

        def average() -> list[pb.Delta]:
            mean = {name: torch.stack([d[name] for d in rnd.deltas.values()]).mean(0) for name in self.shapes}
            return encode_deltas(mean, self.codec)

        rnd.result = pb.AverageReply(
            round=rnd.number, deltas=await asyncio.to_thread(average), contributors=contributors
        )
        rnd.done.set()
        self._results[rnd.number] = rnd.result
        while len(self._results) > KEEP_RESULTS:
            self._results.popitem(last=False)
        self._rounds.pop(rnd.number, None)
