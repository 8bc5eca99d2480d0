"""One assignment's block at work: a Stage owns everything that lives and dies with an assignment.

The runner, codec policy, link bounds, sanity statistics, links, replica set and (on the first stage) the
data source belong to one Stage, built from one signed plan view. A re-assignment closes the Stage whole:
its tasks are cancelled and its links closed, and any work still in flight holds a reference to its own
(closed) Stage, so it drops its result instead of acting on the new block. No generation counters.

The data path lives here, once: decode -> sanity -> forward/backward -> encode -> route, for packets from
neighbours and for the data source alike. The Stage never reaches into the peer around it: what it needs
(the compute thread, a way to report a fault, channels, the checkpoint uploader) is given at construction.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from peer.compute import BACKWARD, FORWARD, OTHER, ComputeWorker
from peer.faults import Faults, wire_policy
from peer.links import DOWNSTREAM, UPSTREAM, Links, dial
from peer.plan_trust import AssignmentError
from peer.replicas.replica_set import ReplicaSet
from swarm.config import PROTOCOL_VERSION, HFConfig, ModelConfig, TrainConfig
from swarm.dht.multiaddrs import multiaddr_to_grpc_target
from swarm.dht.plan_view import PlanView, wire_codecs
from swarm.pb import control_pb2 as cpb
from swarm.pb import wire_pb2 as pb
from swarm.train.memory import MemoryProbe
from swarm.train.stage_factory import build_runner
from swarm.train.stage_runner import StageRunner
from swarm.wire.codec_policy import WirePolicy
from swarm.wire.packets import WireError
from swarm.wire.receive_bounds import link_bounds
from swarm.wire.sample_deltas import DeltaReceiver, DeltaSender, NotCached, SampleDeltas
from swarm.wire.sanity import DAEMON_SETTINGS, LinkSanity, Quarantine, SanityError
from swarm.wire.transport import Link, LinkClosed, hello_packet

log = logging.getLogger(__name__)
Snapshot = tuple[int, dict, dict]  # (weight version, weights, optimizer state) taken in a step


class GradientSink(Protocol):
    """The data source of the first stage: gradients coming back end there instead of going upstream."""

    async def on_gradients(self, g: pb.Gradients, sender: str) -> None: ...

    def cancel(self) -> None: ...


@dataclass(frozen=True)
class StageHooks:
    """What a Stage needs from the peer around it, handed over at construction."""

    peer_id: str
    compute: ComputeWorker
    fail: Callable[[str], Awaitable[None]]  # a fault this stage cannot repair: tell the coordinator
    channel: Callable[[str, str, str], Awaitable[grpc.aio.Channel]]  # (target, peer, pinned fingerprint)
    checkpoint: Callable[[Stage, Snapshot], Awaitable[None]]  # a step took a checkpoint: upload it
    quarantine: Quarantine  # outlives stages: a quarantined neighbour stays so across re-assignments
    faults: Faults
    link_timeout: float
    device: str
    stopping: asyncio.Event  # the peer is going: a link that ends now is no fault


class Stage:
    """The block of one assignment: build with :meth:`build`, drop with :meth:`close`."""

    def __init__(
        self,
        hooks: StageHooks,
        a: cpb.Assignment,
        view: PlanView,
        configs: tuple[ModelConfig, TrainConfig, HFConfig | None],
        runner: StageRunner,
        number: int,
        memory: MemoryProbe | None = None,
    ) -> None:
        self.hooks, self.assignment, self.view, self.number = hooks, a, view, number
        self.model_cfg, self.train_cfg, self.hf = configs
        self.runner = runner
        self.memory = memory or MemoryProbe(hooks.device)  # what building and training the block cost
        self.bounds = link_bounds(self.model_cfg, self.train_cfg)  # what neighbours may send this block
        codecs = wire_codecs(view, self.train_cfg.wire_forward, self.train_cfg.wire_backward)
        self.policy: WirePolicy = wire_policy(
            codecs.forward,
            codecs.backward,
            hooks.faults.poison,
            hooks.faults.poison_after,
            lambda: runner.version,
            error_feedback=self.train_cfg.error_feedback_backward,
            backward_to=codecs.backward_to,
            zstd=self.train_cfg.wire_zstd,
            rank=self.train_cfg.wire_rank,
        )
        t = self.train_cfg  # activations of returning samples sent as changes (--wire-forward-delta)
        delta = t.wire_forward_delta
        self.deltas = SampleDeltas(delta, t.delta_cache_bytes, t.delta_spill_bytes) if delta else None
        self._unsent: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # encoded once routed: deltas
        self.sanity = LinkSanity(DAEMON_SETTINGS, hooks.quarantine)  # per-link norms; quarantines poisoners
        self.links = Links(set(view.downstreams))
        self.replicas = ReplicaSet(
            view,
            runner,
            self.train_cfg,
            run_id=a.run_id,
            assignment_number=number,
            sanity=self.sanity,
            channel=self.replica_channel,
        )
        self.source: GradientSink | None = None  # the data source, on the first stage
        self.closed = False
        self.refused = 0  # streams ended for bad input
        self.lost_micro_batches = 0
        self.stepped = asyncio.Event()
        self._origin: dict[int, str] = {}  # micro-batch id -> the upstream holder its gradient goes back to
        self._sent: dict[int, pb.MicroBatch] = {}  # micro-batches out downstream, in case their holder vanishes
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def build(cls, hooks: StageHooks, a: cpb.Assignment, view: PlanView, configs, number: int) -> Stage:
        """Build this assignment's block on the compute thread (AssignmentError when it cannot be built)."""
        model_cfg, train_cfg, hf = configs
        (start, end) = view.layers
        probe = MemoryProbe(hooks.device)

        def build() -> StageRunner:  # on the compute thread, so the peaks are this build's
            probe.before_build()
            runner = build_runner(model_cfg, train_cfg, start, end, hooks.device, hf)
            probe.after_build(runner.model)
            return runner

        try:
            runner = await hooks.compute.run(build)
        except (ValueError, OSError) as e:
            raise AssignmentError(f"cannot build layers [{start}, {end}): {e}") from e
        return cls(hooks, a, view, configs, runner, number, probe)

    # ---- lifecycle ------------------------------------------------------------------------------
    def spawn(self, coro, name: str) -> asyncio.Task:
        """Run ``coro`` as part of this Stage: it is cancelled when the Stage is closed."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    def start(self) -> None:
        """Open the links this peer dials and start averaging (the other links are dialled by the far end)."""
        for side, peer, endpoint in self.view.to_dial():
            self.spawn(self._dial(side, peer, endpoint), name=f"dial-{peer}")
        if self.replicas.group is not None:
            self.spawn(self.replicas.average_loop(self.stepped, self.compute), name="average")

    def close(self) -> None:
        """Drop this Stage whole: its tasks, its links and its data source; work in flight sees ``closed``."""
        self.closed = True
        if self.source is not None:
            self.source.cancel()
        for task in self._tasks:
            task.cancel()
        self.links.close()
        self._origin.clear()
        self._sent.clear()

    async def compute(self, fn, *args, priority: int = OTHER):
        """Run ``fn`` on the compute thread; a checkpoint its step took is handed to the uploader."""
        result = await self.hooks.compute.run(fn, *args, priority=priority)
        self.stepped.set()
        snapshot, self.runner.pending_checkpoint = self.runner.pending_checkpoint, None
        if snapshot is not None and not self.closed:  # else a step of an assignment we no longer hold
            await self.hooks.checkpoint(self, snapshot)
        return result

    def hello(self) -> pb.Packet:
        return hello_packet(self.hooks.peer_id, self.view.stage, self.assignment.run_id, PROTOCOL_VERSION)

    def pin(self, peer: str) -> str:
        """The TLS fingerprint the signed plan gives ``peer`` ("": it serves in clear)."""
        return next((p.tls_fingerprint for st in self.view.plan.stages for p in st.peers if p.peer_id == peer), "")

    async def replica_channel(self, target: str, peer: str) -> grpc.aio.Channel:
        return await self.hooks.channel(target, peer, self.pin(peer))

    # ---- links ----------------------------------------------------------------------------------
    def accepts(self, peer: str) -> str | None:
        """The side a link from ``peer`` is on, or None when the plan makes it no neighbour that dials us."""
        if peer in self.view.upstreams:
            return UPSTREAM
        if self.view.accept_downstream and peer in self.view.downstreams:
            return DOWNSTREAM
        return None

    def attach(self, side: str, peer: str, link: Link) -> bool:
        """A link is up; False (and nothing attached) when this Stage is already closed."""
        if self.closed:
            return False
        self.links.attach(side, peer, link)
        return True

    async def _dial(self, side: str, peer: str, endpoint: str) -> None:
        target = multiaddr_to_grpc_target(endpoint)
        try:
            channel = await self.hooks.channel(target, peer, self.pin(peer))
        except Exception as e:  # noqa: BLE001 - a TLS pin that does not match, or no route
            if not self.closed and not self.hooks.stopping.is_set():
                await self.hooks.fail(f"refusing to link to {side} {peer} at {target}: {e}")
            return
        try:
            link, reason = await dial(
                channel,
                target,
                f"{self.hooks.peer_id}->{peer}",
                side,
                peer,
                self.hello(),
                timeout=self.hooks.link_timeout,
                max_packet_bytes=self.bounds.max_packet_bytes,
                attach=lambda lk: self.attach(side, peer, lk),
                on_packet=self.on_packet,
                on_refused=self.count_refused,
            )
            if reason:
                await self.link_closed(side, peer, link, reason)
        finally:
            await channel.close()

    def count_refused(self) -> None:
        """A stream of this Stage ended for bad input."""
        self.refused += 1

    async def link_closed(self, side: str, peer: str, link: Link, reason: str, *, report: bool = True) -> None:
        """A neighbour's link ended. A vanished replica is routed around; a lost only neighbour is a fault."""
        if not self.links.detach(side, peer, link) or self.closed or self.hooks.stopping.is_set():
            return  # it dialled again (the new link replaced this one), this block is gone, or so is the peer
        table = self.links.table(side)
        if table and not (side == DOWNSTREAM and self.replicas.router is None):
            log.warning("%s; %d other holder(s) of that block remain: routing around it", reason, len(table))
            if side == DOWNSTREAM:
                await self._lose_downstream(peer)
            else:
                await self._expect_shares(self.replicas.lose_upstream(peer))
            return
        if report:
            await self.hooks.fail(reason)

    async def update(self, a: cpb.Assignment, view: PlanView) -> None:
        """Same block, fewer neighbours or replicas (one left): forget the gone ones, keep training."""
        if view.layers != self.view.layers or view.stage != self.view.stage or a.epoch != self.assignment.epoch:
            raise AssignmentError("an update must keep this peer's block; the coordinator sent another")
        self.view, self.assignment = view, a
        codecs = wire_codecs(view, self.train_cfg.wire_forward, self.train_cfg.wire_backward)
        self.policy.forward, self.policy.backward_to = codecs.forward, codecs.backward_to  # the new plan's links
        for side, holders in ((DOWNSTREAM, view.downstreams), (UPSTREAM, view.upstreams)):
            for peer, link in [(p, lk) for p, lk in self.links.table(side).items() if p not in holders]:
                link.close()
                await self.link_closed(side, peer, link, f"{peer} left the plan", report=False)
        gone_down, gone_up = self.replicas.update(view)
        for peer in gone_down:
            await self._lose_downstream(peer)
        for peer in gone_up:
            await self._expect_shares(self.replicas.lose_upstream(peer))
        self.links.expected_downstreams = set(view.downstreams)
        log.info(
            "plan updated: upstream %s, downstream %s, replicas %s",
            sorted(view.upstreams),
            sorted(view.downstreams),
            sorted(view.replicas),
        )

    async def _lose_downstream(self, peer: str) -> None:
        """A downstream replica vanished: its micro-batches will never come back; drop and count them."""
        lost = self.replicas.lose_downstream(peer)
        self.lost_micro_batches += len(lost)
        for mb_id in lost:
            mb = self._sent.pop(mb_id, None)
            if mb is not None:
                await self.on_gradients(pb.Gradients(mb=mb, dropped=True), "")

    # ---- the data path --------------------------------------------------------------------------
    async def on_packet(self, link: Link, packet: pb.Packet) -> None:
        """Route one packet from a neighbour; raises WireError/StageInputError for bad input."""
        kind = packet.WhichOneof("body")
        if self.closed:
            raise WireError("this peer no longer holds that block")
        sender = link.remote.peer_id if link.remote is not None else ""
        self.bounds.check_packet(packet)  # every tensor fits this block, before anything is decoded
        if kind == "activations":
            if not self.links.is_from(UPSTREAM, sender, link):
                raise WireError("activations may only come from an upstream neighbour")
            await self._on_activations(packet.activations, sender, link)
        elif kind == "gradients":
            if not self.links.is_from(DOWNSTREAM, sender, link):
                raise WireError("gradients may only come from a downstream neighbour")
            await self.on_gradients(packet.gradients, sender)
        elif kind == "step_end":
            if not self.links.is_from(UPSTREAM, sender, link):
                raise WireError("step markers may only come from an upstream neighbour")
            await self._expect_shares(self.replicas.marker(packet.step_end.step, sender, packet.step_end.count))
        elif kind == "hello":
            raise WireError("unexpected second hello on an open link")
        else:
            raise WireError(f"unexpected packet kind {kind!r}")

    async def _on_activations(self, act: pb.Activations, sender: str, link: Link) -> None:
        self._origin[act.mb.id] = sender
        rows = None  # the rows this link's deltas are against; its sender's only (made here, on the event loop)
        if act.cache != pb.CACHE_NONE:
            if self.deltas is None:
                raise WireError("activation deltas in a run that sends none")
            rows = self.deltas.receiver(link)
        packet = await self.compute(self._forward_job, act, sender, rows, priority=FORWARD)
        if self.closed:  # re-assigned meanwhile: this micro-batch belongs to the old plan
            return
        if packet.WhichOneof("body") == "activations":
            await self.send_down(packet)
        else:
            await self.send_up(packet)

    async def on_gradients(self, g: pb.Gradients, sender: str) -> None:
        """A gradient (or an eval loss, or a drop) came back from ``sender`` ("": its holder vanished)."""
        self.replicas.returned(g.mb.id)
        self._sent.pop(g.mb.id, None)
        link = self.links.downstreams.get(sender)
        if g.dropped and self.deltas is not None and link is not None:  # it may not hold what we hold for them
            self.deltas.sender(link).dropped(list(g.mb.samples))
        if self.source is not None:  # the first stage: the data source accounts for it
            await self.source.on_gradients(g, sender)
            return
        packet = await self.compute(self.backward_job, g, sender, priority=BACKWARD)
        if not self.closed:
            await self.send_up(packet)

    def plausible(self, x: torch.Tensor, sender: str, kind: str) -> bool:
        """Does ``x`` pass this link's sanity checks? (Compute thread.) A refused tensor is counted against
        ``sender``; enough of them quarantine it, and the next report asks the coordinator to exclude it.
        Non-float tensors pass here: the runner's shape and dtype checks refuse them, ending the stream."""
        if not x.is_floating_point():
            return True
        was = self.sanity.quarantine.excluded(sender)
        try:
            self.sanity.check(x, sender=sender, link=sender, kind=kind)
            return True
        except SanityError as e:
            if not was:  # once quarantined, every tensor from it is refused: no need to log each
                log.warning("rejected %s from %s: %s", kind, sender, e)
            return False

    def _forward_job(self, act: pb.Activations, sender: str, rows: DeltaReceiver | None) -> pb.Packet:
        runner = self.runner
        if not act.mb.eval:
            self.hooks.faults.slow(self.view.stage)
        x = self.policy.decode(act.hidden)
        targets = self.policy.decode(act.targets) if act.HasField("targets") else None
        if rows is not None:
            try:
                x = rows.rebuild(act, x)
            except NotCached as e:
                log.warning("micro-batch %d from %s dropped: %s", act.mb.id, sender, e)
                return pb.Packet(gradients=pb.Gradients(mb=act.mb, dropped=True))
        if not self.plausible(x, sender, "activations"):  # dropped: upstream drops it too, nothing waits
            return pb.Packet(gradients=pb.Gradients(mb=act.mb, dropped=True))
        if rows is not None:
            rows.commit(act, x)
        result = runner.forward(act.mb.id, x, targets, train=not act.mb.eval, step=act.mb.step)
        if not act.mb.eval:
            self.replicas.received(act.mb.step, sender)
        if result.output is not None:
            mb = pb.MicroBatch()
            mb.CopyFrom(act.mb)
            mb.weight_version = runner.version
            return self._own_output(act.mb, lambda: self.outgoing(mb, result.output, targets), pending=not act.mb.eval)
        return self._own_output(
            act.mb, lambda: self.policy.gradients(act.mb, result.input_grad, result.loss_sum, result.tokens, to=sender)
        )

    def backward_job(self, g: pb.Gradients, sender: str) -> pb.Packet:
        """Decode, check and apply one gradient from ``sender`` (compute thread); the packet for upstream.

        The one backward path: the data source uses it too (and only reads whether it was dropped)."""
        if g.mb.eval:
            packet = self.policy.gradients(g.mb, None, g.loss_sum, g.tokens, to="")
            packet.gradients.dropped = g.dropped
            return packet
        grad = None if g.dropped else self.policy.decode(g.grad)
        if grad is not None and not self.view.is_first:  # (the data source is never slowed down)
            self.hooks.faults.slow(self.view.stage)
        if grad is not None and not self.plausible(grad, sender, "gradients"):
            grad = None  # dropped here and, through the dropped packet, upstream
        result = self.runner.backward(g.mb.id, grad)
        if result.dropped:
            return pb.Packet(gradients=pb.Gradients(mb=g.mb, dropped=True, loss_sum=g.loss_sum, tokens=g.tokens))
        if self.view.is_first:  # the data source: nothing goes further up
            return pb.Packet(gradients=pb.Gradients(mb=g.mb, loss_sum=g.loss_sum, tokens=g.tokens))
        origin = self._origin.get(g.mb.id, "")  # the upstream holder that sent this micro-batch: its residual
        return self._own_output(
            g.mb,
            lambda: self.policy.gradients(g.mb, result.input_grad, g.loss_sum, g.tokens, to=origin),
            loss_sum=g.loss_sum,
            tokens=g.tokens,
        )

    def _own_output(self, mb: pb.MicroBatch, encode, *, pending: bool = False, **dropped) -> pb.Packet:
        """Encode this stage's own result. If that fails, the fault is ours, not the sender's (its input passed
        every check): say so, and drop the micro-batch (``pending``: free its graph here) so nothing waits."""
        try:
            return encode()
        except WireError as e:
            log.error("cannot encode this stage's own output for micro-batch %d: %s; dropped", mb.id, e)
            if pending:
                self.runner.backward(mb.id, None)
            return pb.Packet(gradients=pb.Gradients(mb=mb, dropped=True, **dropped))

    async def _expect_shares(self, ready: list[tuple[int, int]]) -> None:
        """This replica's share of some steps is now known: its optimizer may step, its markers go on."""
        for step, share in ready:
            due = self.replicas.expect(step, share)
            await self.compute(self.runner.expect, share, priority=BACKWARD)
            await self._send_step_ends(due)

    async def _send_step_ends(self, due: list[tuple[int, dict[str, int]]]) -> None:
        for step, counts in due:
            for peer, count in counts.items():
                link = self.links.downstreams.get(peer)
                if link is not None and not link.closed.is_set():
                    try:
                        await link.send(pb.Packet(step_end=pb.StepEnd(step=step, count=count)))
                    except LinkClosed:
                        pass  # that holder is gone; its upstream-loss handling covers the step

    def outgoing(self, mb: pb.MicroBatch, output: torch.Tensor, targets: torch.Tensor | None) -> pb.Packet:
        """The packet of this stage's output (compute thread). Under activation deltas it is encoded once
        routed, in :meth:`send_down`, against that link's rows: this packet carries only the targets."""
        if self.deltas is None or not mb.samples or mb.eval:
            return self.policy.activations(mb, output, targets)
        self._unsent[mb.id] = (output, targets)
        return pb.Packet(activations=pb.Activations(mb=mb))

    async def send_down(self, packet: pb.Packet) -> None:
        """Send activations to one holder of the next block: the one expected to finish it first."""
        mb = packet.activations.mb
        peer = self.replicas.route(mb.id)
        self._sent[mb.id] = mb
        unsent = self._unsent.pop(mb.id, None)
        try:
            link = self.links.downstreams[peer]
            if unsent is None:
                await link.send(packet)
            else:
                async with self.deltas.lock(link):  # the receiver applies them in the order they were encoded
                    rows = self.deltas.sender(link)
                    packet = await self.compute(self._encode_for, rows, mb, *unsent, priority=FORWARD)
                    if packet.WhichOneof("body") == "gradients":
                        await self.on_gradients(packet.gradients, "")  # could not be encoded: dropped
                        return
                    await link.send(packet)
        except (KeyError, LinkClosed):  # vanished between choice and send: its link handling drops it
            pass
        if not mb.eval:
            await self._send_step_ends(self.replicas.forwarded(mb.step, peer))

    def _encode_for(self, rows: DeltaSender, mb: pb.MicroBatch, output: torch.Tensor, targets) -> pb.Packet:
        return self._own_output(mb, lambda: self.policy.activations(mb, output, targets, rows, self.deltas.codec))

    async def send_up(self, packet: pb.Packet) -> None:
        """Send a gradient (or an eval loss) back to exactly the holder that sent us its forward."""
        peer = self._origin.pop(packet.gradients.mb.id, None)
        link = self.links.upstreams.get(peer) if peer is not None else None
        if link is None or link.closed.is_set():
            return  # that upstream holder vanished; our own weights already have this gradient
        try:
            await link.send(packet)
        except LinkClosed:
            pass
