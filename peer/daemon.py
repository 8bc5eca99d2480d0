"""The peer daemon: one block of layers behind a gRPC Stage service, steered by the coordinator.

Lifecycle: start the Stage server, join the coordinator (dialled by us: works behind NAT), then obey
its commands in order: assign (build the block, link to the downstream neighbour), start (the first
stage drives training), collect state (upload the block), shutdown. Compute runs on one dedicated
thread so the event loop keeps receiving and sending while a micro-batch is being computed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import grpc
import torch

from peer.compute import BACKWARD, FORWARD, OTHER, ComputeWorker
from peer.discovery import Discovery, DiscoveryError
from peer.driver import Driver
from peer.probe import measure_bandwidth
from peer.stage_service import StageService
from swarm import auth, limits
from swarm.codec_policy import WirePolicy
from swarm.config import MODEL_PRESETS, PROTOCOL_VERSION, HFConfig
from swarm.dht_schema import PeerRecord, Plan
from swarm.measure import device_name, free_memory_bytes, layer_throughput
from swarm.messages import AssignmentError, assignment_configs, check_assignment
from swarm.metrics import MetricsServer
from swarm.multiaddrs import grpc_target_to_multiaddr, multiaddr_to_grpc_target
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.resume import ATTACHED_KEY, ResumeClaim
from swarm.stage_factory import build_runner
from swarm.stage_runner import StageInputError, StageRunner
from swarm.transport import GRPC_OPTIONS, Link, LinkClosed, hello_packet, read_hello, refuse_client_stream
from swarm.wire import Reassembler, WireError, split_packet, tensor_to_pb

log = logging.getLogger(__name__)
SOFTWARE_VERSION = "0.1.0"


@dataclass
class PeerSettings:
    """Everything a peer needs to know before it has an assignment."""

    peer_id: str
    host: str = "127.0.0.1"
    port: int = 0
    announce: str = ""
    device: str = "auto"
    threads: int = 0
    report_interval: float = 1.0
    step_timeout: float = 300.0
    link_timeout: float = 30.0
    plan_timeout: float = 600.0
    status_every: float = 10.0  # seconds between the one-line live status in the log
    leave_timeout: float = 60.0  # how long a graceful leave waits for the coordinator to take the block
    coordinator_grace: float = 60.0  # how long to train on and redial when the coordinator is gone (0: exit at once)
    slowdown: float = 0.0  # testing: an artificially slow peer
    hf_path: str = ""  # where this peer keeps the Hugging Face checkpoint, if not where the coordinator says
    metrics_port: int | None = None  # Prometheus endpoint (None: off)
    metrics_host: str = "127.0.0.1"
    swarm_token: str = ""  # proof of membership on every gRPC call (empty: no authentication, tests only)
    extra: dict[str, str] = field(default_factory=dict)

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


class PeerDaemon:
    """Owns the server, the coordinator session, the links and the stage runner of one peer."""

    def __init__(self, settings: PeerSettings, discovery: Discovery | None = None) -> None:
        self.settings = settings
        self.discovery = discovery
        self.plan: Plan | None = None
        self.generation = 0
        self.metrics_server = MetricsServer()
        self.metrics = self.metrics_server.peer(settings.peer_id)
        self._dial_tasks: list[asyncio.Task] = []
        self.hf: HFConfig | None = None
        self.peer_id = settings.peer_id
        self.device = settings.resolved_device()
        self.compute = ComputeWorker()
        self.runner: StageRunner | None = None
        self.assignment: cpb.Assignment | None = None
        self.policy = WirePolicy()
        self.upstream: Link | None = None
        self.downstream: Link | None = None
        self.downstream_ready = asyncio.Event()
        self.assigned = asyncio.Event()
        self.driver: Driver | None = None
        self.endpoint = ""
        self.refused = 0
        self.stopping = asyncio.Event()
        self.leaving = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._control: cgrpc.ControlStub | None = None
        self._channel: grpc.aio.Channel | None = None
        self._tasks: list[asyncio.Task] = []
        self._pending: cpb.StatusReport | None = None  # undelivered steps/evals/flags, merged; sent on re-attach
        self._report_lock = asyncio.Lock()  # reports reach the coordinator in the order they were made
        self._attached = False  # the coordinator accepted our Join and the stream is up

    # ---- compute thread -------------------------------------------------------------------------
    async def run_compute(self, fn, *args, priority: int = OTHER):
        result = await self.compute.run(fn, *args, priority=priority)
        runner = self.runner
        if runner is not None and runner.pending_checkpoint is not None:
            snapshot, runner.pending_checkpoint = runner.pending_checkpoint, None
            self._tasks.append(asyncio.create_task(self._upload_checkpoint(*snapshot), name="checkpoint"))
        return result

    def channel(self, target: str, audience: str = auth.COORDINATOR_AUDIENCE, **kw) -> grpc.aio.Channel:
        """A channel whose every call carries this peer's proof of swarm membership for ``audience``."""
        interceptors = (
            auth.client_interceptors(self.settings.swarm_token, self.peer_id, audience)
            if self.settings.swarm_token
            else None
        )
        return grpc.aio.insecure_channel(target, options=GRPC_OPTIONS, interceptors=interceptors, **kw)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start_server(self) -> str:
        interceptors = []
        if self.settings.swarm_token:
            verifier = auth.Verifier(self.settings.swarm_token, audiences=[self.peer_id])
            interceptors = [auth.ServerAuth(verifier), limits.ServerLimits()]
        self._server = grpc.aio.server(options=GRPC_OPTIONS + limits.SERVER_OPTIONS, interceptors=interceptors)
        wgrpc.add_StageServicer_to_server(StageService(self), self._server)
        port = self._server.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        if port == 0:
            raise OSError(f"cannot listen on {self.settings.host}:{self.settings.port}")
        await self._server.start()
        self.endpoint = grpc_target_to_multiaddr(f"{self.settings.announce or self.settings.host}:{port}")
        log.info("stage service listening on %s", self.endpoint)
        return self.endpoint

    async def run(self) -> int:
        """Find the swarm, serve until the coordinator says shutdown or the session breaks; an exit code."""
        if self.settings.threads > 0:
            torch.set_num_threads(self.settings.threads)
        disc = self.discovery
        try:
            disc.start()  # the DHT forks a process: before any gRPC thread exists
            if self.settings.metrics_port is not None:
                port = self.metrics_server.start(self.settings.metrics_port, self.settings.metrics_host)
                log.info("Prometheus metrics on http://%s:%d/metrics", self.settings.metrics_host, port)
            log.info("DHT up; looking for swarm %r", disc.s.swarm)
            plan = await self._unless_stopped(disc.find_swarm())
            reachable = await self._check_reachable(plan)
            await self.start_server()
            record = await self._measure(plan, reachable)
            await disc.announce(record)
            self._tasks.append(asyncio.create_task(disc.heartbeat(), name="heartbeat"))
            log.info(
                "announced in swarm %r (%.1f layers/s, %.1f/%.1f MB/s up/down); waiting for a block",
                disc.s.swarm,
                record.throughput_layers_per_s,
                record.bandwidth_up_bytes_per_s / 1e6,
                record.bandwidth_down_bytes_per_s / 1e6,
            )
            self.plan = await self._unless_stopped(disc.wait_for_block(self.peer_id, self.settings.plan_timeout))
            return await self._session(multiaddr_to_grpc_target(self.plan.coordinator))
        except DiscoveryError as e:
            log.error("%s", e)
            return 2
        except asyncio.CancelledError:
            return 0
        finally:
            await self.close()

    async def _unless_stopped(self, coro):
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self.stopping.wait())
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            raise asyncio.CancelledError
        stop.cancel()
        return task.result()

    async def _check_reachable(self, plan: Plan) -> bool:
        """Ask the coordinator to dial our stage endpoint back; behind NAT we become a DHT client.

        A throw-away listener on the stage port answers the dial-back (the real server starts later, after
        any DHT restart: hivemind forks, and forking after gRPC threads exist is unsafe).
        """
        probe = grpc.aio.server(options=GRPC_OPTIONS)
        port = probe.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        await probe.start()
        endpoint = grpc_target_to_multiaddr(f"{self.settings.announce or self.settings.host}:{port}")
        try:
            async with self.channel(multiaddr_to_grpc_target(plan.coordinator)) as ch:
                reply = await cgrpc.ControlStub(ch).DialBack(cpb.DialBackRequest(endpoint=endpoint), timeout=15)
            reachable, detail = reply.reachable, reply.detail
        except grpc.aio.AioRpcError as e:
            reachable, detail = True, f"could not check ({e.details()}); assuming reachable"
        finally:
            await probe.stop(grace=None)
        self.settings = dataclasses.replace(self.settings, port=port)  # keep the port that was checked
        if not reachable:
            log.warning("not reachable from outside (%s): this peer will dial its neighbours", detail)
            await asyncio.to_thread(self.discovery.restart_as_client)
        return reachable

    async def _measure(self, plan: Plan, reachable: bool = True) -> PeerRecord:
        cfg = MODEL_PRESETS.get(plan.model_name, MODEL_PRESETS["gpt-small"])
        throughput = await self.run_compute(layer_throughput, cfg, self.device)
        up, down = await measure_bandwidth(self.channel(multiaddr_to_grpc_target(plan.coordinator)))
        return PeerRecord(
            peer_id=self.peer_id,
            endpoint=self.endpoint,
            device=device_name(self.device),
            free_memory_bytes=free_memory_bytes(self.device),
            throughput_layers_per_s=throughput,
            bandwidth_up_bytes_per_s=up,
            bandwidth_down_bytes_per_s=down,
            state="joining",
            software_version=SOFTWARE_VERSION,
            protocol_version=PROTOCOL_VERSION,
            timestamp=time.time(),
            reachable=reachable,
        )

    async def _session(self, coordinator: str) -> int:
        """The control session with the coordinator: obey its commands in order, and outlive its restart.

        When the stream breaks, this peer keeps training and serving its block for ``coordinator_grace``
        seconds while it redials (the endpoint named by the newest signed plan); a restarted coordinator
        adopts it if its block still matches the plan. Reports that could not be delivered meanwhile are
        kept and sent on re-attach, so the coordinator sees every step exactly once.
        """
        self._tasks.append(asyncio.create_task(self._report_loop(), name="report"))
        grace, ever_attached, lost_at, delay = self.settings.coordinator_grace, False, 0.0, 0.5
        while True:
            try:
                await self._obey(coordinator, resuming=ever_attached)
                return 0
            except grpc.aio.AioRpcError as e:
                if self.stopping.is_set():
                    return 0
                if not ever_attached and not self._attached:
                    log.error("lost the coordinator at %s: %s", coordinator, e.details())
                    return 2
                if self._attached:  # a new outage starts now
                    self._attached, ever_attached, lost_at, delay = False, True, time.monotonic(), 0.5
                    log.warning(
                        "lost the coordinator at %s (%s); training on and redialling for up to %.0f s",
                        coordinator,
                        e.details(),
                        grace,
                    )
                else:
                    log.info("coordinator not back yet (%s)", e.details())
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

    async def _obey(self, coordinator: str, *, resuming: bool) -> None:
        """One control stream: join (claiming our block when resuming), then run its commands until it ends."""
        if self._channel is not None:
            await self._channel.close()  # a fresh channel: no reconnect backoff left over from the outage
        self._channel = self.channel(coordinator, auth.COORDINATOR_AUDIENCE)
        self._control = cgrpc.ControlStub(self._channel)
        join = cpb.JoinRequest(
            peer_id=self.peer_id,
            endpoint=self.endpoint,
            protocol_version=PROTOCOL_VERSION,
            device=self.device,
            free_memory=free_memory_bytes(self.device),
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
                if not self._attached:
                    self._on_attached("assigned", resuming)
                kind = command.WhichOneof("body")
                log.info("command from coordinator: %s", kind)
                if kind == "assign":
                    await self._on_assign(command.assign)
                elif kind == "start":
                    self._start_driver(command.start)
                elif kind == "stop_training":
                    if self.driver is not None:
                        self.driver.stop_after_step()
                elif kind == "collect_state":
                    if command.collect_state.checkpoint:
                        runner = self.runner
                        version, (weights, optim) = runner.version, await self.run_compute(runner.checkpoint_state)
                        await self._upload_checkpoint(version, weights, optim)
                    else:
                        await self._upload_state()
                elif kind == "shutdown":
                    log.info("shutdown requested by the coordinator: %s", command.shutdown.reason)
                    break
        finally:
            stop_wait.cancel()

    def _on_attached(self, how: str, resuming: bool) -> None:
        self._attached = True
        if resuming:
            log.info(
                "re-attached to the coordinator (%s); %d undelivered step reports follow",
                "it adopted our block" if how == "adopted" else "it re-assigns our block",
                len(self._pending.steps) if self._pending is not None else 0,
            )
            self._tasks.append(asyncio.create_task(self._after_reattach(), name="reattach"))

    async def _after_reattach(self) -> None:
        await self.report()  # flushes what piled up while the coordinator was away
        if self.discovery is not None and not await self.discovery.rejoin():
            log.warning("the coordinator's DHT node did not answer; the plan may reach this peer late")

    def _claim(self) -> ResumeClaim | None:
        """What we hold, for a restarted coordinator to compare with its plan."""
        a, runner = self.assignment, self.runner
        if a is None or runner is None or self.plan is None:
            return None
        return ResumeClaim(
            run_id=a.run_id,
            plan_version=self.plan.version,
            stage=a.stage,
            layer_start=a.layer_start,
            layer_end=a.layer_end,
            weight_version=runner.version,
            generation=self.generation,
        )

    async def _coordinator_target(self, current: str) -> str:
        """The control endpoint of the newest signed plan (a coordinator may come back elsewhere)."""
        if self.discovery is None:
            return current
        try:
            plan = await asyncio.wait_for(self.discovery.fetch(), 10)
        except Exception as e:  # noqa: BLE001 - keep dialling the endpoint we know
            log.info("could not read the plan from the DHT: %s", e)
            return current
        return multiaddr_to_grpc_target(plan.coordinator) if plan is not None else current

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except TimeoutError:
            pass

    def request_leave(self) -> None:
        """First Ctrl-C/SIGTERM: hand the block over through the coordinator, then go; the second: go now."""
        if self.leaving.is_set() or self.assignment is None or self._control is None or not self._attached:
            self.stopping.set()  # (no coordinator to hand the block to while it is away: go now)
            return
        self.leaving.set()
        log.info(
            "leaving: handing layers [%d, %d) over (press Ctrl-C again to quit at once)",
            self.assignment.layer_start,
            self.assignment.layer_end,
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
        self.stopping.set()
        self.metrics_server.stop()
        if self.discovery is not None:
            try:
                await asyncio.wait_for(self.discovery.leave(), 10)
            except Exception as e:  # noqa: BLE001 - leaving is best effort; the record expires anyway
                log.warning("could not withdraw this peer's record: %s", e)
            self.discovery.shutdown()
        if self.driver is not None:
            self.driver.cancel()
        for link in (self.upstream, self.downstream):
            if link is not None:
                link.close()
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self._channel is not None:
            await self._channel.close()
        await asyncio.to_thread(self.compute.close)

    # ---- commands -------------------------------------------------------------------------------
    async def _on_assign(self, a: cpb.Assignment) -> None:
        if self.assignment is not None:
            await self._reset_stage()
        await self._check_against_plan(a)
        model_cfg, train_cfg, hf = assignment_configs(a)
        if hf is not None and self.settings.hf_path:
            hf = dataclasses.replace(hf, path=self.settings.hf_path)
        self.hf = hf
        self.policy = WirePolicy(forward=train_cfg.wire_forward, backward=train_cfg.wire_backward)
        try:
            self.runner = await self.run_compute(
                build_runner, model_cfg, train_cfg, a.layer_start, a.layer_end, self.device, hf
            )
        except (ValueError, OSError) as e:
            raise AssignmentError(f"cannot build layers [{a.layer_start}, {a.layer_end}): {e}") from e
        if a.restore_version:
            await self._restore(a.restore_version)
        self.metrics.set_assignment(a.stage, a.layer_start, a.layer_end, train_cfg.micro_batch_size * model_cfg.context)
        self.assignment = a
        self.assigned.set()
        log.info(
            "assigned stage %d/%d: layers [%d, %d) on %s",
            a.stage,
            a.num_stages,
            a.layer_start,
            a.layer_end,
            self.device,
        )
        if self.runner.is_first:
            self.driver = Driver(self, train_cfg, model_cfg, hf)
            await self.run_compute(self.driver.load_data)
        self._dial_tasks = []
        if a.downstream_endpoint and not a.accept_downstream:
            self._dial_tasks.append(asyncio.create_task(self._dial(a, self.generation, "downstream")))
        if a.upstream_endpoint and a.dial_upstream:  # we are behind NAT: we open the link to our upstream
            self._dial_tasks.append(asyncio.create_task(self._dial(a, self.generation, "upstream")))
        self._tasks.extend(self._dial_tasks)
        if a.downstream_endpoint:  # dialled by us, or by a downstream peer behind NAT
            await asyncio.wait_for(self.downstream_ready.wait(), self.settings.link_timeout)
        await self.report(ready=True)
        if self.discovery is not None and self.discovery.record is not None:
            block = {"layer_start": a.layer_start, "layer_end": a.layer_end}
            online = {**self.discovery.record.to_dht_value(), "state": "online", "block": block}
            await self.discovery.announce(PeerRecord.model_validate(online))

    async def _check_against_plan(self, a: cpb.Assignment, timeout: float = 15.0) -> None:
        """The assignment must match the signed plan; a new plan may take a moment to reach our DHT node."""
        if self.plan is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                check_assignment(a, self.plan, self.peer_id)
                return
            except AssignmentError:
                if self.discovery is None or time.monotonic() > deadline:
                    raise
            newer = await self.discovery.fetch()
            if newer is not None:
                self.plan = newer
            else:
                await asyncio.sleep(0.2)

    async def _reset_stage(self) -> None:
        """Drop the current block, links and data source: a new assignment replaces them."""
        self.generation += 1
        if self.driver is not None:
            self.driver.cancel()
            self.driver = None
        for task in self._dial_tasks:
            task.cancel()
        self._dial_tasks = []
        for link in (self.upstream, self.downstream):
            if link is not None:
                link.close()
        self.upstream = self.downstream = None
        self.downstream_ready = asyncio.Event()
        self.assigned.clear()
        self.assignment = None
        self.runner = None

    async def _restore(self, version: int) -> None:
        """Load this block's weights and optimizer state at ``version`` from the coordinator's store."""
        request = cpb.FetchStateRequest(peer_id=self.peer_id, version=version, names=self.runner.parameter_names())
        reasm = Reassembler(message_type=cpb.StateChunk)
        chunk = None
        async for frame in self._control.FetchState(request, timeout=120):
            chunk = reasm.push(frame) or chunk
        if chunk is None:
            raise AssignmentError(f"the coordinator sent no state for version {version}")
        weights = {t.name: self.policy.decode(t.tensor) for t in chunk.tensors}
        optim = {t.name: self.policy.decode(t.tensor) for t in chunk.optimizer}
        await self.run_compute(self.runner.restore, version, weights, optim)
        log.info("restored %d tensors at weight version %d", len(weights), version)

    async def _upload_checkpoint(self, version: int, weights: dict, optim: dict) -> None:
        a, generation = self.assignment, self.generation
        if a is None or self._control is None:
            return

        def build() -> cpb.StateChunk:
            chunk = cpb.StateChunk(
                peer_id=self.peer_id,
                stage=a.stage,
                version=version,
                layer_start=a.layer_start,
                layer_end=a.layer_end,
                periodic=True,
            )
            for name, t in weights.items():
                chunk.tensors.add(name=name, tensor=tensor_to_pb(t.float(), "fp32"))
            for name, t in optim.items():
                chunk.optimizer.add(name=name, tensor=tensor_to_pb(t.float(), "fp32"))
            return chunk

        chunk = await asyncio.to_thread(build)

        async def frames():
            for frame in split_packet(chunk, version):
                yield frame

        try:
            await self._control.UploadState(frames(), timeout=300)
        except grpc.aio.AioRpcError as e:
            if generation == self.generation:
                log.warning("checkpoint v%d upload failed: %s", version, e.details())

    def _start_driver(self, start: cpb.Start) -> None:
        if self.driver is None:
            log.warning("start command on a stage that is not the data source; ignored")
            return
        self._tasks.append(asyncio.create_task(self.driver.run(start.first_step, start.num_steps), name="driver"))

    async def _upload_state(self) -> None:
        assert self.runner is not None and self.assignment is not None
        await self.report()  # final stats reach the coordinator before the state does (its summary uses them)
        from swarm.wire import tensor_to_pb

        state = await self.run_compute(self.runner.state_dict)
        chunk = cpb.StateChunk(peer_id=self.peer_id, stage=self.assignment.stage)
        for name, tensor in state.items():
            chunk.tensors.add(name=name, tensor=tensor_to_pb(tensor.float(), "fp32"))

        async def frames():
            for frame in split_packet(chunk, 1):
                yield frame

        reply = await self._control.UploadState(frames())
        log.info("uploaded %d tensors of stage %d", reply.tensors, self.assignment.stage)

    # ---- links ----------------------------------------------------------------------------------
    def hello(self) -> pb.Packet:
        a = self.assignment
        return hello_packet(self.peer_id, a.stage if a else 0, a.run_id if a else "", PROTOCOL_VERSION)

    async def _dial(self, a: cpb.Assignment, generation: int, side: str) -> None:
        """Open the link to a neighbour (``side``: "downstream" normally, "upstream" when we are behind NAT)."""
        peer, endpoint = (
            (a.downstream_peer, a.downstream_endpoint)
            if side == "downstream"
            else (a.upstream_peer, a.upstream_endpoint)
        )
        target = multiaddr_to_grpc_target(endpoint)
        channel = self.channel(target, peer)
        link = Link(f"{self.peer_id}->{peer}")
        call = wgrpc.StageStub(channel).Link()
        try:
            for frame in split_packet(self.hello(), 0):
                await call.write(frame)
            hello = await read_hello(call, link, self.settings.link_timeout)
            if hello.peer_id != peer:
                raise WireError(f"expected {side} peer {peer}, reached {hello.peer_id}")
            if side == "downstream":
                self.downstream = link
                self.downstream_ready.set()
            else:
                self.upstream = link
            await link.run(call, self.on_packet)
            await self._link_failed(generation, f"{side} peer {peer} closed the link")
        except (WireError, StageInputError) as e:
            self.refused += 1
            await refuse_client_stream(call, link, str(e))
            await self._link_failed(generation, f"refused a packet from {side} {peer}: {e}")
        except (TimeoutError, grpc.aio.AioRpcError, LinkClosed) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            await self._link_failed(generation, f"link to {side} {peer} at {target} failed: {detail}")
        finally:
            await channel.close()

    async def _link_failed(self, generation: int, reason: str) -> None:
        """Report a broken link, unless it belonged to an assignment that was already replaced."""
        if generation == self.generation and not self.stopping.is_set():
            await self.fail(reason)

    async def on_packet(self, link: Link, packet: pb.Packet) -> None:
        """Route one packet from a neighbour; raises WireError/StageInputError for bad input."""
        kind = packet.WhichOneof("body")
        if self.runner is None:
            raise WireError("this peer has no block assigned yet")
        if kind == "activations":
            if link is not self.upstream:
                raise WireError("activations may only come from the upstream neighbour")
            await self._on_activations(packet.activations)
        elif kind == "gradients":
            if link is not self.downstream:
                raise WireError("gradients may only come from the downstream neighbour")
            await self._on_gradients(packet.gradients)
        elif kind == "hello":
            raise WireError("unexpected second hello on an open link")
        else:
            raise WireError(f"unexpected packet kind {kind!r}")

    async def _on_activations(self, act: pb.Activations) -> None:
        target_down, target_up, generation = self.downstream, self.upstream, self.generation
        packet = await self.run_compute(self._forward_job, act, self.runner, priority=FORWARD)
        if generation != self.generation:  # re-assigned meanwhile: this micro-batch belongs to the old plan
            return
        await (target_down if packet.WhichOneof("body") == "activations" else target_up).send(packet)

    def _forward_job(self, act: pb.Activations, runner: StageRunner) -> pb.Packet:
        if self.settings.slowdown:
            time.sleep(self.settings.slowdown)
        x = self.policy.decode(act.hidden)
        targets = self.policy.decode(act.targets) if act.HasField("targets") else None
        result = runner.forward(act.mb.id, x, targets, train=not act.mb.eval)
        if result.output is not None:
            mb = pb.MicroBatch()
            mb.CopyFrom(act.mb)
            mb.weight_version = runner.version
            return self.policy.activations(mb, result.output, targets)
        return self.policy.gradients(act.mb, result.input_grad, result.loss_sum, result.tokens)

    async def _on_gradients(self, g: pb.Gradients) -> None:
        if self.driver is not None:
            await self.driver.on_gradients(g)
            return
        target, generation = self.upstream, self.generation
        packet = await self.run_compute(self._backward_job, g, self.runner, priority=BACKWARD)
        if generation == self.generation and target is not None:
            await target.send(packet)

    def _backward_job(self, g: pb.Gradients, runner: StageRunner) -> pb.Packet:
        if g.mb.eval:
            return self.policy.gradients(g.mb, None, g.loss_sum, g.tokens)
        grad = None if g.dropped else self.policy.decode(g.grad)
        result = runner.backward(g.mb.id, grad)
        if result.dropped:
            return pb.Packet(gradients=pb.Gradients(mb=g.mb, dropped=True, loss_sum=g.loss_sum, tokens=g.tokens))
        return self.policy.gradients(g.mb, result.input_grad, g.loss_sum, g.tokens)

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> cpb.StageStats:
        links = [lk for lk in (self.upstream, self.downstream) if lk is not None]
        r = self.runner
        return cpb.StageStats(
            forward_micro_batches=r.metrics.forward if r else 0,
            backward_micro_batches=r.metrics.backward if r else 0,
            bytes_sent=sum(lk.bytes_sent for lk in links),
            bytes_received=sum(lk.bytes_received for lk in links),
            compute_seconds=r.metrics.compute_seconds if r else 0.0,
            weight_version=r.version if r else 0,
            refused=self.refused,
            dropped=r.metrics.dropped if r else 0,
            staleness_counts=r.metrics.staleness_counts() if r else [],
            idle_seconds=self.compute.idle_seconds,
            wall_seconds=time.monotonic() - self.compute.started,
            stash_bytes_peak=r.metrics.stash_bytes_peak if r else 0,
            in_flight_peak=r.metrics.in_flight_peak if r else 0,
        )

    async def report(self, **fields) -> None:
        """Send our stats; a report that carries more (steps, evals, ready, finished, an error, leaving) is
        kept until the coordinator has it, and sent before anything newer, also across a coordinator restart."""
        stats = self.stats()
        self.metrics.update(stats)
        msg = cpb.StatusReport(peer_id=self.peer_id, stats=stats, **fields)
        async with self._report_lock:
            if any(fields.values()):
                self._pending = merge_reports(self._pending, msg)
            if self._control is None or not self._attached:
                return
            out = self._pending or msg
            out.stats.CopyFrom(stats)
            try:
                await self._control.Report(out, timeout=10.0)
                if out is self._pending:
                    self._pending = None
            except grpc.aio.AioRpcError as e:
                log.warning("report to the coordinator failed: %s", e.details())

    async def _report_loop(self) -> None:
        last_line, last = time.monotonic(), self.stats()
        while not self.stopping.is_set():
            await asyncio.sleep(self.settings.report_interval)
            await self.report()
            if time.monotonic() - last_line >= self.settings.status_every and self.assignment is not None:
                now = self.stats()
                log.info("%s", status_line(self.assignment, last, now, time.monotonic() - last_line))
                last_line, last = time.monotonic(), now

    async def fail(self, reason: str) -> None:
        """A fault this peer cannot repair: tell the coordinator, which decides what happens next."""
        log.error(reason)
        await self.report(error=reason)


def merge_reports(pending: cpb.StatusReport | None, new: cpb.StatusReport) -> cpb.StatusReport:
    """One report that says everything ``pending`` and ``new`` say, in order (one call, however long the outage)."""
    if pending is None:
        merged = cpb.StatusReport()
        merged.CopyFrom(new)
        return merged
    pending.steps.extend(new.steps)
    pending.evals.extend(new.evals)
    pending.ready |= new.ready
    pending.finished |= new.finished
    pending.leaving |= new.leaving
    pending.error = pending.error or new.error
    pending.stats.CopyFrom(new.stats)
    return pending


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


def status_line(a: cpb.Assignment, then: cpb.StageStats, now: cpb.StageStats, seconds: float) -> str:
    """The peer's one-line live status: what it holds and how fast it moves."""
    dt = max(seconds, 1e-9)
    mbs = (now.forward_micro_batches - then.forward_micro_batches) / dt
    up = (now.bytes_sent - then.bytes_sent) * 8 / dt / 1e6
    down = (now.bytes_received - then.bytes_received) * 8 / dt / 1e6
    busy = 1 - (now.idle_seconds - then.idle_seconds) / dt
    return (
        f"training stage {a.stage} layers [{a.layer_start},{a.layer_end}) | weights v{now.weight_version} | "
        f"{mbs:.1f} micro-batches/s | up {up:.1f} down {down:.1f} Mbit/s | compute busy {busy:.0%}"
        + (f" | dropped {now.dropped}" if now.dropped else "")
    )
