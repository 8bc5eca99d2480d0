"""The peer's session with the coordinator: the control stream and the commands on it, in order.

Join (claiming our block when resuming), then obey: assign (a fresh :class:`peer.stage.Stage` from the
assignment's signed plan; the old one is closed whole), start (the first stage's data source), update
(same block, fewer holders around it), stop training, collect state, shutdown. When the stream breaks
the peer trains on and redials for ``--coordinator-grace`` (the endpoint of the newest signed plan); a
restarted coordinator adopts it, and the reports kept meanwhile follow (``peer.reports``). A first
Ctrl-C leaves gracefully: the coordinator takes the block over, then releases the peer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time

import grpc

from peer.checkpoints import Checkpoints, restore_block
from peer.compute import ComputeWorker
from peer.control_channel import Channels, ControlAddress, failure_detail
from peer.discovery import Discovery
from peer.driver import Driver
from peer.faults import Faults
from peer.plan_trust import AssignmentError, PlanTrust
from peer.reports import Reporter, stage_stats, status_line
from peer.settings import PeerSettings
from peer.stage import Stage, StageHooks
from swarm.config import PROTOCOL_VERSION
from swarm.dht.plan_view import PlanView
from swarm.dht.schema import PeerRecord, Plan
from swarm.messages import assignment_configs
from swarm.metrics import PeerMetrics
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.resume import ATTACHED_KEY, ResumeClaim
from swarm.security import tls
from swarm.security.identity import plan_keys
from swarm.train.measure import free_memory_bytes
from swarm.wire.sanity import Quarantine

log = logging.getLogger(__name__)
SOFTWARE_VERSION = "0.1.0"


class Session:
    """The coordinator session of one peer process and the Stage of its current assignment."""

    def __init__(
        self,
        settings: PeerSettings,
        faults: Faults,
        trust: PlanTrust,
        channels: Channels,
        compute: ComputeWorker,
        metrics: PeerMetrics,
        stopping: asyncio.Event,
        discovery: Discovery | None = None,
    ) -> None:
        self.settings, self.faults, self.trust, self.channels = settings, faults, trust, channels
        self.peer_id, self.device = settings.peer_id, settings.resolved_device()
        self.compute, self.metrics, self.stopping, self.discovery = compute, metrics, stopping, discovery
        self.endpoint = ""  # our Stage service, set once it listens
        self.plan: Plan | None = None  # the newest signed plan this peer knows (DHT, then assignments)
        self.stage: Stage | None = None
        self.assignments = 0  # how many this process has had
        self.quarantine = Quarantine()  # outlives stages: a quarantined neighbour stays quarantined
        self.leaving = asyncio.Event()
        self.attached = False  # the coordinator accepted our Join and the stream is up
        self._assigned = asyncio.Event()
        self._control: cgrpc.ControlStub | None = None
        self._channel: grpc.aio.Channel | None = None
        self._tasks: list[asyncio.Task] = []
        self.reporter = Reporter(
            self.peer_id, self.stats, self.quarantine, metrics, lambda: self._control, lambda: self.attached
        )
        self.checkpoints = Checkpoints(self.peer_id, lambda: self._control, lambda: self.attached, faults)

    # ---- what others ask of the session ---------------------------------------------------------
    def stats(self) -> cpb.StageStats:
        return stage_stats(self.stage, self.compute)

    async def report(self, **fields) -> None:
        await self.reporter.report(**fields)

    async def fail(self, reason: str, *, epoch: int = 0) -> None:
        await self.reporter.fail(reason, epoch=epoch)

    def peer_key(self, peer: str) -> str | None:
        """The key the signed plan pins for ``peer`` (None: not in our plan): who may call in its name."""
        plan = self.stage.view.plan if self.stage is not None else self.plan
        return plan_keys(plan).get(peer) if plan is not None else None

    async def wait_stage(self, timeout: float) -> Stage | None:
        """The current Stage, waiting up to ``timeout`` for the first assignment (None: none came)."""
        try:
            await asyncio.wait_for(self._assigned.wait(), timeout)
        except TimeoutError:
            return None
        return self.stage

    # ---- the control stream ---------------------------------------------------------------------
    async def run(self, coordinator: ControlAddress) -> int:
        """Obey the coordinator until it releases us, and outlive its restart; an exit code."""
        self._tasks.append(asyncio.create_task(self._report_loop(), name="report"))
        grace, ever_attached, lost_at, delay = self.settings.coordinator_grace, False, 0.0, 0.5
        while True:
            try:
                await self._obey(coordinator, resuming=ever_attached)
                return 0
            except (grpc.aio.AioRpcError, tls.TlsError) as e:
                if self.stopping.is_set():
                    return 0
                if not ever_attached and not self.attached:
                    log.error("lost the coordinator at %s: %s", coordinator, failure_detail(e))
                    return 2
                if self.attached:  # a new outage starts now
                    self.attached, ever_attached, lost_at, delay = False, True, time.monotonic(), 0.5
                    log.warning(
                        "lost the coordinator at %s (%s); training on and redialling for up to %.0f s",
                        coordinator,
                        failure_detail(e),
                        grace,
                    )
                else:
                    log.info("coordinator not back yet (%s)", failure_detail(e))
                if time.monotonic() - lost_at >= grace:
                    log.error(
                        "lost the coordinator at %s and it did not come back within %.0f s (--coordinator-grace); "
                        "leaving the swarm",
                        coordinator,
                        grace,
                    )
                    return 2
                await self._sleep_unless_stopped(delay)
                delay = min(2 * delay, 5.0)
                coordinator = await self._coordinator_target(coordinator)
            except (TimeoutError, AssignmentError) as e:
                log.error("%s", e)
                await self.fail(str(e))
                return 2

    async def _obey(self, coordinator: ControlAddress, *, resuming: bool) -> None:
        """One control stream: join (claiming our block when resuming), then run its commands until it ends."""
        channel = await self.channels.coordinator(coordinator)  # TLS: checks the pin before anything is sent
        if self._channel is not None:
            await self._channel.close()  # a fresh channel: no reconnect backoff left over from the outage
        self._channel, self._control = channel, cgrpc.ControlStub(channel)
        if coordinator.pin:
            log.info("joining the coordinator at %s over TLS, certificate pinned to %s", coordinator, coordinator.pin)
        join = cpb.JoinRequest(
            peer_id=self.peer_id,
            endpoint=self.endpoint,
            protocol_version=PROTOCOL_VERSION,
            device=self.device,
            free_memory=self.settings.offered_memory(free_memory_bytes(self.device)),
            software_version=SOFTWARE_VERSION,
        )
        claim = self._claim() if resuming else None
        commands = self._control.Join(join, metadata=claim.metadata() if claim else None)
        attached = dict(await commands.initial_metadata() or ()).get(ATTACHED_KEY)
        if attached is not None:
            self._on_attached(attached, resuming)
        stop_wait = asyncio.create_task(self.stopping.wait())
        try:  # a stream that ends without an error is the coordinator releasing this peer
            async for command in _until(commands, stop_wait):
                if not self.attached:
                    self._on_attached("assigned", resuming)
                if not await self._command(command):
                    break
        finally:
            stop_wait.cancel()

    async def _command(self, command: cpb.Command) -> bool:
        """Carry out one command; False when it ends the session (shutdown)."""
        kind = command.WhichOneof("body")
        log.info("command from coordinator: %s", kind)
        stage = self.stage
        if kind == "assign":
            await self._on_assign(command.assign)
        elif kind == "start":
            if stage is None or not isinstance(stage.source, Driver):
                log.warning("start command on a stage that is not the data source; ignored")
            else:
                stage.spawn(stage.source.run(command.start.first_step, command.start.num_steps), name="driver")
        elif kind == "update":
            if stage is None:
                raise AssignmentError("an update for a peer that holds no block")
            await stage.update(command.update, self._accept(command.update))
        elif kind == "stop_training":
            if stage is not None and isinstance(stage.source, Driver):
                stage.source.stop_after_step()
        elif kind == "collect_state" and stage is not None:
            if command.collect_state.checkpoint:
                await self.checkpoints.checkpoint_now(stage)
            else:
                await stage.replicas.final_average(stage.compute)
                await self.report()  # final stats reach the coordinator before the state (its summary uses them)
                await self.checkpoints.upload_final(stage)
        elif kind == "shutdown":
            log.info("shutdown requested by the coordinator: %s", command.shutdown.reason)
            return False
        return True

    def _accept(self, a: cpb.Assignment) -> PlanView:
        view = self.trust.accept(a)  # signed by the trusted key, for our run, never an older plan
        self.plan = view.plan
        return view

    def _on_attached(self, how: str, resuming: bool) -> None:
        self.attached = True
        if resuming:
            pending = self.reporter.pending
            log.info(
                "re-attached to the coordinator (%s); %d undelivered step reports follow",
                "it adopted our block" if how == "adopted" else "it re-assigns our block",
                len(pending.steps) if pending is not None else 0,
            )
            self._tasks.append(asyncio.create_task(self._after_reattach(), name="reattach"))

    async def _after_reattach(self) -> None:
        await self.report()  # flushes what piled up while the coordinator was away
        if self.discovery is not None and not await self.discovery.rejoin():
            log.warning("the coordinator's DHT node did not answer; the plan may reach this peer late")

    def _claim(self) -> ResumeClaim | None:
        """What we hold, for a restarted coordinator to compare with its plan."""
        stage = self.stage
        if stage is None:
            return None
        return ResumeClaim(
            run_id=stage.assignment.run_id,
            plan_version=stage.view.plan.version,
            stage=stage.view.stage,
            layer_start=stage.view.layers[0],
            layer_end=stage.view.layers[1],
            weight_version=stage.runner.version,
            generation=stage.number,
            epoch=stage.assignment.epoch,
        )

    async def _coordinator_target(self, current: ControlAddress) -> ControlAddress:
        """The control endpoint and pin of the newest signed plan (a coordinator may come back elsewhere)."""
        if self.discovery is None:
            return current
        try:
            plan = await asyncio.wait_for(self.discovery.fetch(), 10)
        except Exception as e:  # noqa: BLE001 - keep dialling the endpoint we know
            log.info("could not read the plan from the DHT: %s", e)
            return current
        return ControlAddress.of(plan) if plan is not None else current

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except TimeoutError:
            pass

    # ---- assignments ----------------------------------------------------------------------------
    async def _on_assign(self, a: cpb.Assignment) -> None:
        """A new block: close the old Stage whole, build a fresh one from the signed plan, link it up."""
        view = self._accept(a)
        if self.stage is not None:
            self._assigned.clear()
            self.stage.close()
            self.stage = None
        model_cfg, train_cfg, hf = assignment_configs(a)
        if hf is not None and self.settings.hf_path:
            hf = dataclasses.replace(hf, path=self.settings.hf_path)
        fail = functools.partial(self.fail, epoch=a.epoch)  # a fault of this block names its plan epoch
        hooks = StageHooks(
            peer_id=self.peer_id,
            compute=self.compute,
            fail=fail,
            channel=self.channels.stage,
            checkpoint=self.checkpoints.on_snapshot,
            quarantine=self.quarantine,
            faults=self.faults,
            link_timeout=self.settings.link_timeout,
            device=self.device,
            stopping=self.stopping,
        )
        stage = await Stage.build(hooks, a, view, (model_cfg, train_cfg, hf), self.assignments)
        self.assignments += 1
        if a.restore_version:
            await restore_block(self._control, self.peer_id, stage.runner, a.restore_version, self.compute.run)
        (start, end) = view.layers
        self.metrics.set_assignment(view.stage, start, end, train_cfg.micro_batch_size * model_cfg.context)
        self.stage = stage
        self._assigned.set()
        log.info(
            "assigned stage %d/%d: layers [%d, %d) on %s; wire %s forward, %s backward (error feedback %s)",
            view.stage,
            view.num_stages,
            start,
            end,
            self.device,
            stage.policy.forward,
            ", ".join(f"{c} to {p}" for p, c in stage.policy.backward_to.items()) or stage.policy.backward,
            stage.policy.feedback_text(),
        )
        if view.is_first:
            driver = Driver(
                stage,
                train_cfg,
                model_cfg,
                hf,
                report=self.report,
                fail=fail,
                step_timeout=self.settings.step_timeout,
            )
            stage.source = driver
            await stage.compute(driver.load_data)
        stage.start()
        if view.downstreams:  # dialled by us, or by downstream peers behind NAT
            await asyncio.wait_for(stage.links.downstream_ready.wait(), self.settings.link_timeout)
        await self.report(ready=True)
        if self.discovery is not None and self.discovery.record is not None:
            block = {"layer_start": start, "layer_end": end}
            online = {**self.discovery.record.to_dht_value(), "state": "online", "block": block}
            await self.discovery.announce(PeerRecord.model_validate(online))

    # ---- reports, leaving, closing --------------------------------------------------------------
    async def _report_loop(self) -> None:
        last_line, last = time.monotonic(), self.stats()
        while not self.stopping.is_set():
            await asyncio.sleep(self.settings.report_interval)
            await self.report()
            if time.monotonic() - last_line >= self.settings.status_every and self.stage is not None:
                now = self.stats()
                log.info("%s", status_line(self.stage, last, now, time.monotonic() - last_line))
                last_line, last = time.monotonic(), now

    def request_leave(self) -> None:
        """First Ctrl-C/SIGTERM: hand the block over through the coordinator, then go; the second: go now."""
        if self.leaving.is_set() or self.stage is None or self._control is None or not self.attached:
            self.stopping.set()  # (no coordinator to hand the block to while it is away: go now)
            return
        self.leaving.set()
        log.info(
            "leaving: handing layers [%d, %d) over (press Ctrl-C again to quit at once)",
            *self.stage.view.layers,
        )
        self._tasks.append(asyncio.create_task(self._leave_gracefully()))

    async def _leave_gracefully(self) -> None:
        await self.report(leaving=True)
        try:  # the coordinator checkpoints the swarm, then releases us with a shutdown
            await asyncio.wait_for(self.stopping.wait(), self.settings.leave_timeout)
        except TimeoutError:
            log.warning(
                "the coordinator did not release this peer within %.0f s; leaving anyway", self.settings.leave_timeout
            )
            self.stopping.set()

    async def close(self) -> None:
        """Drop the Stage and the control channel (the daemon stops the rest)."""
        if self.stage is not None:
            self.stage.close()
        for task in self._tasks:
            task.cancel()
        if self._channel is not None:
            await self._channel.close()


async def _until(stream, stop: asyncio.Task):
    """Iterate a server stream, ending early when ``stop`` completes."""
    iterator = stream.__aiter__()
    while True:
        nxt = asyncio.ensure_future(iterator.__anext__())
        done, _ = await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
        if nxt not in done:
            nxt.cancel()
            stream.cancel()
            return
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return
