"""The replica side of one Stage: routing to the next block, step shares and averaging, owned together.

A Stage asks this object where a micro-batch goes, tells it what came back or vanished, and hands it
step markers; it answers with the bookkeeping the Stage must act on (lost micro-batches, step shares
to expect, markers to send on). Averaging runs here too, every T local steps, on the Stage's compute
thread. Nothing here sends packets: the Stage owns the links.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from peer.compute import BACKWARD
from peer.plan_trust import AssignmentError
from peer.replicas.averaging import AverageGroup
from peer.replicas.routing import ReplicaRouter
from peer.replicas.shares import SenderSplit, UpstreamShares
from swarm.config import TrainConfig
from swarm.dht.multiaddrs import multiaddr_to_grpc_target
from swarm.dht.plan_view import PlanView
from swarm.train.stage_runner import StageRunner
from swarm.wire.packets import WireError
from swarm.wire.sanity import LinkSanity

log = logging.getLogger(__name__)
FINAL_ROUND = 1 << 40  # averaging rounds at the end of a run are numbered from here (never periodic ones)
Ready = list[tuple[int, int]]  # (step, this replica's share of it) whose share is now known


class ReplicaSet:
    """Router, step shares and averaging group of one assignment (each None where the plan needs none)."""

    def __init__(
        self,
        view: PlanView,
        runner: StageRunner,
        train: TrainConfig,
        *,
        run_id: str,
        assignment_number: int,
        sanity: LinkSanity,
        channel: Callable[[str, str], Awaitable[grpc.aio.Channel]],
    ) -> None:
        ups, downs = view.upstreams, view.downstreams
        self.train, self.runner = train, runner
        self.router = ReplicaRouter(list(downs)) if downs else None
        partial = view.replicated or len(ups) > 1  # not every micro-batch passes here: count shares from markers
        self.split: SenderSplit | None = None  # step markers for a replicated downstream block
        if downs and (len(downs) > 1 or view.replicated):  # the next stage counts shares: tell it ours
            self.split = SenderSplit(list(downs), fixed=None if partial else train.micro_batches)
        self.shares: UpstreamShares | None = None  # this peer is a replica: its share of each step
        if partial:
            runner.use_quotas()
            self.shares = UpstreamShares(list(ups))
        self.group: AverageGroup | None = None
        self.anchor_digest = ""
        self._lock = asyncio.Lock()
        if not view.replicated:
            return
        if view.is_first:
            raise AssignmentError("the first block (the data source) cannot have replicas")
        runner.start_averaging()
        self.anchor_digest = runner.agreed.digest()
        self.group = AverageGroup(
            view.peer_id,
            {p: multiaddr_to_grpc_target(e) for p, e in view.replicas.items()},
            run_id=run_id,
            layers=view.layers,
            shapes={n: tuple(t.shape) for n, t in runner.agreed.anchor.items()},
            codec=train.average_codec,
            timeout=train.average_timeout,
            channel=channel,
            generation=assignment_number,
            sanity=sanity,  # a lying replica is charged and quarantined like a poisoning neighbour
        )

    # ---- routing and shares ---------------------------------------------------------------------
    def route(self, mb_id: int) -> str:
        """The holder of the next block that gets this micro-batch (the one expected to finish it first)."""
        peer = self.router.choose()
        self.router.sent(peer, mb_id)
        return peer

    def forwarded(self, step: int, peer: str) -> list[tuple[int, dict[str, int]]]:
        """A training micro-batch of ``step`` went to ``peer``; the step markers now due."""
        if self.split is None:
            return []
        self.split.forwarded(step, peer)
        return self.split.complete()

    def returned(self, mb_id: int) -> None:
        if self.router is not None:
            self.router.returned(mb_id)

    def lose_downstream(self, peer: str) -> list[int]:
        """A downstream holder vanished: the micro-batches it held, which never come back."""
        if self.router is None:
            return []
        lost = self.router.remove(peer)
        if self.split is not None:
            self.split.remove(peer)
        return lost

    def marker(self, step: int, sender: str, count: int) -> Ready:
        if self.shares is None:
            raise WireError("step marker sent to a stage that sees every micro-batch (no replicas before it)")
        try:
            return self.shares.marker(step, sender, count)
        except ValueError as e:
            raise WireError(str(e)) from None

    def lose_upstream(self, peer: str) -> Ready:
        """An upstream holder vanished: what it sent is all it sends; the steps it left open complete."""
        return self.shares.remove(peer) if self.shares is not None else []

    def received(self, step: int, sender: str) -> None:
        """An activation of ``step`` from ``sender`` was computed here (compute thread)."""
        if self.shares is not None:
            self.shares.received(step, sender)

    def expect(self, step: int, share: int) -> list[tuple[int, dict[str, int]]]:
        """This replica's share of ``step`` is known; the step markers now due downstream."""
        if self.split is None:
            return []
        self.split.expect(step, share)
        return self.split.complete()

    def update(self, view: PlanView) -> tuple[list[str], list[str]]:
        """Same block, fewer holders around it: (gone downstream holders, gone upstream holders)."""
        gone_down = [p for p in self.router.peers if p not in view.downstreams] if self.router else []
        gone_up = [p for p in self.shares.upstreams if p not in view.upstreams] if self.shares else []
        if self.group is not None and view.replicated:
            self.group.set_members({p: multiaddr_to_grpc_target(e) for p, e in view.replicas.items()})
        elif self.group is not None:  # the last other replica left: nothing to average with any more
            log.info("no other replica of layers [%d, %d) is left: averaging stops", *view.layers)
            self.group = None
        return gone_down, gone_up

    # ---- averaging ------------------------------------------------------------------------------
    async def average_loop(self, stepped: asyncio.Event, compute: Callable[..., Awaitable]) -> None:
        """Every T local steps, average this block's change with its replicas (a task of the Stage)."""
        every = self.train.average_every
        next_round = 1
        while self.group is not None:
            if self.runner.version < next_round * every:
                stepped.clear()
                await stepped.wait()
                continue
            async with self._lock:
                next_round = self.runner.version // every
                await self._round(next_round, compute)
            next_round += 1

    async def final_average(self, compute: Callable[..., Awaitable]) -> None:
        """At the end of a run: one last round with training stopped, so every replica holds the same weights."""
        if self.group is None:
            return
        async with self._lock:
            await self._round(FINAL_ROUND + self.runner.version, compute)

    async def _round(self, number: int, compute: Callable[..., Awaitable]) -> bool:
        group, runner = self.group, self.runner
        if group is None:
            return False
        own = await compute(runner.agreed.delta, priority=BACKWARD)
        result = await group.contribute(number, own)
        if result is None:
            return False
        average, contributors = result
        train = self.train

        def apply() -> str:
            runner.apply_average(average, own, train.outer_lr, train.outer_momentum)
            return runner.agreed.digest()

        self.anchor_digest = await compute(apply, priority=BACKWARD)
        group.rounds_applied += 1
        log.info(
            "average round %d applied (%s); agreed parameters %s", number, ", ".join(contributors), self.anchor_digest
        )
        return True
