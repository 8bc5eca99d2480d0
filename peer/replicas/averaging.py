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

Contributions come from other members, so they are bounded like any received tensor: each change has
exactly its parameter's shape (checked on the header, before decoding), is finite, and its L2 norm is at
most ``NORM_FACTOR`` times the receiver's own recent change plus ``NORM_FLOOR``; replicas train the same
block on the same schedule, so honest changes are of one size. A refused contribution is left out of the
average and charged to its sender with the refusal accounting of :mod:`swarm.wire.sanity` (enough of them
quarantine it, and the coordinator excludes it); a quarantined sender is refused at once. A contributor
checks the leader's answer the same way and applies nothing (charging the leader) when it is too large.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import torch

from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.wire.packets import WireError, tensor_from_pb, tensor_to_pb
from swarm.wire.sanity import LinkSanity

log = logging.getLogger(__name__)
KEEP_RESULTS = 16  # closed rounds whose result a late replica can still fetch
NORM_FACTOR = 10.0  # a received change may be this many times the receiver's own recent change ...
NORM_FLOOR = 1e-3  # ... plus this L2 norm (harmless to any block), for a replica that has barely moved
KEEP_OWN_NORMS = 4  # own changes of this many recent rounds; the largest is the reference


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
    norms: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # sender -> why its contribution was left out


def encode_deltas(deltas: dict[str, torch.Tensor], codec: str) -> list[pb.Delta]:
    return [pb.Delta(name=name, tensor=tensor_to_pb(t.float().contiguous(), codec)) for name, t in deltas.items()]


def decode_deltas(items, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """Decode a set of changes; with ``shapes``, each must be one of the block's parameters, with its exact
    shape (checked on the header, so nothing larger than the parameter is ever allocated)."""
    out = {}
    for d in items:
        if shapes is not None and d.name not in shapes:
            raise WireError(f"parameter {d.name!r} is not part of this block")
        if d.name in out:
            raise WireError(f"parameter {d.name!r} twice in one contribution")
        shape = shapes[d.name] if shapes is not None else None
        bound = {} if shape is None else {"expect_shape": shape, "max_elements": max(math.prod(shape), 1)}
        try:
            t = tensor_from_pb(d.tensor, **bound)
        except WireError as e:
            raise WireError(f"change of {d.name}: {e}") from None
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise WireError(f"change of {d.name} is not a finite floating-point tensor")
        out[d.name] = t.float()
    return out


def delta_norm(deltas: dict[str, torch.Tensor]) -> float:
    """The L2 norm of a whole change, over every parameter."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in deltas.values()))


def norm_refusal(norm: float, reference: float) -> str | None:
    """Why a change of ``norm`` is implausible next to the receiver's own ``reference``, or None."""
    limit = NORM_FACTOR * reference + NORM_FLOOR
    if math.isfinite(norm) and norm <= limit:
        return None
    return (
        f"change of norm {norm:.3g} exceeds {NORM_FACTOR:g} x this replica's own recent change "
        f"({reference:.3g}) + {NORM_FLOOR:g}"
    )


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
        sanity: LinkSanity | None = None,  # where refusals are charged (the daemon's, shared with its links)
    ) -> None:
        self.me, self.run_id, self.layers, self.codec, self.timeout = me, run_id, layers, codec, timeout
        self.shapes = shapes
        self.generation = generation
        self.sanity = sanity
        self._own_norms: OrderedDict[int, float] = OrderedDict()
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

    def reference_norm(self, round_: int) -> float | None:
        """This replica's largest own change over its recent rounds up to ``round_`` (None: none yet)."""
        return max((n for r, n in self._own_norms.items() if r <= round_), default=None)

    def _charge(self, sender: str, reason: str) -> None:
        log.warning("refused the averaging contribution of %s: %s", sender, reason)
        if self.sanity is not None:
            self.sanity.charge(sender, f"averaging: {reason}")

    # ---- contributor ----------------------------------------------------------------------------
    async def contribute(self, round_: int, delta: dict[str, torch.Tensor]) -> tuple[dict, list[str]] | None:
        """Send this replica's change for ``round_``; the agreed average change, or None (apply nothing)."""
        self._own_norms[round_] = await asyncio.to_thread(delta_norm, delta)
        while len(self._own_norms) > KEEP_OWN_NORMS:
            self._own_norms.popitem(last=False)
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
            average = await asyncio.to_thread(decode_deltas, reply.deltas, self.shapes)
        except (grpc.aio.AioRpcError, AverageRefused, WireError, TimeoutError, OSError, ValueError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.warning(
                "average round %d with leader %s failed (%s); keeping the change for the next", round_, leader, detail
            )
            return None
        if set(average) != set(self.shapes):
            log.warning("average round %d misses parameters; not applied", round_)
            return None
        if leader != self.me:
            reason = norm_refusal(await asyncio.to_thread(delta_norm, average), self.reference_norm(round_))
            if reason is not None:
                self._charge(leader, f"its average of round {round_}: {reason}")
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
        if self.sanity is not None and self.sanity.quarantine.excluded(sender):
            reason = self.sanity.quarantine.reason(sender)
            raise AverageRefused(grpc.StatusCode.PERMISSION_DENIED, f"{sender!r} is quarantined: {reason}")
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
            deltas = await asyncio.to_thread(decode_deltas, request.deltas, self.shapes)
            if set(deltas) != set(self.shapes):
                raise WireError("a contribution must cover every parameter")
        except WireError as e:
            if sender != self.me:
                self._charge(sender, str(e))
            raise AverageRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        norm = await asyncio.to_thread(delta_norm, deltas)
        if sender != self.me:
            self.bytes += request.ByteSize()
            self.absent.discard(sender)
        rnd = self._rounds.get(request.round)
        if rnd is None:
            rnd = self._rounds[request.round] = _Round(request.round, deadline=time.monotonic() + self.timeout)
        rnd.deltas[sender] = deltas
        rnd.norms[sender] = norm
        self._maybe_close(rnd)
        if not rnd.done.is_set():
            try:
                await asyncio.wait_for(rnd.done.wait(), max(0.0, rnd.deadline - time.monotonic()))
            except TimeoutError:
                pass
        if not rnd.done.is_set():
            await self._close(rnd)
        if sender in rnd.refused:
            raise AverageRefused(grpc.StatusCode.INVALID_ARGUMENT, rnd.refused[sender])
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
        self._refuse_outliers(rnd)
        contributors = sorted(rnd.deltas)
        missing = set(self.members) - set(contributors) - set(rnd.refused)  # a refused member is not absent
        if missing:
            log.warning(
                "average round %d closed without %s (timeout); not waiting for them again",
                rnd.number,
                ", ".join(sorted(missing)),
            )
        self.absent |= missing

        def average() -> list[pb.Delta]:
            if not rnd.deltas:  # only refused contributions: an empty answer, which nobody applies
                return []
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

    def _refuse_outliers(self, rnd: _Round) -> None:
        """Leave out (and charge) every other member's change too large next to this replica's own.

        Without an own change yet (this leader's contribution is late in its first round), the median of
        the round's changes is the reference. A refused member is not marked absent: it is waited for
        (and judged) again next round.
        """
        reference = self.reference_norm(rnd.number)
        if reference is None:
            reference = rnd.norms.get(self.me)
        if reference is None:
            norms = sorted(rnd.norms.values())
            reference = norms[(len(norms) - 1) // 2] if norms else 0.0
        for sender in [s for s in rnd.deltas if s != self.me]:
            reason = norm_refusal(rnd.norms[sender], reference)
            if reason is not None:
                del rnd.deltas[sender]
                rnd.refused[sender] = reason
                self._charge(sender, f"round {rnd.number}: {reason}")
