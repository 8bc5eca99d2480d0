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
import os
import time
from dataclasses import dataclass, field

import grpc
import torch

from peer.averaging import AverageGroup
from peer.compute import BACKWARD, FORWARD, OTHER, ComputeWorker
from peer.control_channel import ControlAddress, dial_control, failure_detail
from peer.discovery import Discovery, DiscoveryError
from peer.driver import Driver
from peer.faults import crash_due, wire_policy
from peer.probe import measure_bandwidth
from peer.stage_service import StageService
from swarm import auth, limits, tls
from swarm.checkpoint import state_digest
from swarm.codec_policy import WirePolicy
from swarm.config import PROTOCOL_VERSION, HFConfig
from swarm.dht_schema import PeerRecord, Plan
from swarm.identity import plan_keys
from swarm.measure import device_name, free_memory_bytes, planned_throughput
from swarm.messages import AssignmentError, assignment_configs, check_assignment
from swarm.messages import assignment_neighbours as neighbours
from swarm.metrics import MetricsServer
from swarm.multiaddrs import grpc_target_to_multiaddr, multiaddr_to_grpc_target
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.receive_bounds import LinkBounds, link_bounds
from swarm.record_signing import new_key
from swarm.resume import ATTACHED_KEY, ResumeClaim
from swarm.routing import ReplicaRouter
from swarm.sanity import DAEMON_SETTINGS, LinkSanity, SanityError
from swarm.stage_factory import build_runner
from swarm.stage_runner import StageInputError, StageRunner
from swarm.state_checks import BlockSpec, decode_state
from swarm.step_shares import SenderSplit, UpstreamShares
from swarm.transport import GRPC_OPTIONS, Link, LinkClosed, hello_packet, read_hello, refuse_client_stream
from swarm.wire import Reassembler, WireError, split_packet, tensor_to_pb

log = logging.getLogger(__name__)
SOFTWARE_VERSION = "0.1.0"
FINAL_ROUND = 1 << 40  # averaging rounds at the end of a run are numbered from here (never periodic ones)


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
    slow_stage: tuple[int, float] | None = None  # testing: whoever holds this stage is this much slower per pass
    poison: str = ""  # testing: "scale" or "nan" corrupts every training tensor sent, after poison_after steps
    poison_after: int = 0
    crash_at_checkpoint: tuple[int, int] | None = None  # testing: (stage, version) whose holder dies, see faults
    hf_path: str = ""  # where this peer keeps the Hugging Face checkpoint, if not where the coordinator says
    metrics_port: int | None = None  # Prometheus endpoint (None: off)
    metrics_host: str = "127.0.0.1"
    swarm_token: str = ""  # proof of membership on every gRPC call (empty: no authentication, tests only)
    tls: tls.TlsIdentity | None = None  # the Stage service speaks TLS with this certificate (None: in clear)
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
        # the key of this process's DHT record; every call it makes is signed with it (swarm/identity.py)
        self.signing_key = discovery.signing_key if discovery is not None else new_key()
        self.plan: Plan | None = None
        self.generation = 0
        self._upload: asyncio.Task | None = None  # the newest checkpoint upload (see run_compute)
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
        self.bounds: LinkBounds | None = None  # what neighbours may send this block (set with the assignment)
        self.upstreams: dict[str, Link] = {}  # every holder of the previous block, by peer id
        self.downstreams: dict[str, Link] = {}  # every holder of the next block
        self.downstream_ready = asyncio.Event()
        self.router: ReplicaRouter | None = None  # which downstream holder gets each micro-batch
        self.split: SenderSplit | None = None  # step markers for a replicated downstream block
        self.shares: UpstreamShares | None = None  # this peer is a replica: its share of each step
        self.group: AverageGroup | None = None  # this peer is a replica: parameter averaging
        self._origin: dict[int, str] = {}  # micro-batch id -> the upstream holder its gradient goes back to
        self._sent: dict[int, pb.MicroBatch] = {}  # micro-batches out downstream, in case their holder vanishes
        self.lost_micro_batches = 0
        self._stepped = asyncio.Event()
        self._avg_lock = asyncio.Lock()
        self.anchor_digest = ""
        self.assigned = asyncio.Event()
        self.driver: Driver | None = None
        self.endpoint = ""
        self.refused = 0
        self.sanity = LinkSanity(DAEMON_SETTINGS)  # per-link norm statistics; quarantines poisoned neighbours
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
        generation = self.generation
        result = await self.compute.run(fn, *args, priority=priority)
        self._stepped.set()
        runner = self.runner
        if runner is not None and runner.pending_checkpoint is not None:
            snapshot, runner.pending_checkpoint = runner.pending_checkpoint, None
            if generation == self.generation:  # else a step of an assignment we no longer hold
                previous = self._upload
                if previous is not None and not previous.done() and self._attached:
                    # at most one upload in flight: training runs at most one period ahead of what the
                    # coordinator holds, so a failure redoes fewer than 2C steps however slow uploads are
                    await asyncio.wait([previous])
                self._upload = asyncio.create_task(
                    self._upload_checkpoint(*snapshot, generation=generation), name="checkpoint"
                )
                self._tasks.append(self._upload)
        return result

    def channel(self, target: str, audience: str = auth.COORDINATOR_AUDIENCE, **kw) -> grpc.aio.Channel:
        """A channel whose every call carries this peer's proof of swarm membership for ``audience``."""
        interceptors = (
            auth.client_interceptors(self.settings.swarm_token, self.peer_id, audience, signer=self.signing_key)
            if self.settings.swarm_token
            else None
        )
        return grpc.aio.insecure_channel(target, options=GRPC_OPTIONS, interceptors=interceptors, **kw)

    async def control_channel(self, address: ControlAddress) -> grpc.aio.Channel:
        """A channel to the coordinator, with proofs, pinned to the certificate the signed plan names (if any)."""
        token = self.settings.swarm_token
        interceptors = (
            auth.client_interceptors(token, self.peer_id, auth.COORDINATOR_AUDIENCE, signer=self.signing_key)
            if token
            else None
        )
        return await dial_control(address, interceptors, self.settings.link_timeout)

    def peer_key(self, peer: str) -> str | None:
        """The key the signed plan pins for ``peer`` (None: not in our plan): who may call in its name."""
        return plan_keys(self.plan).get(peer)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start_server(self) -> str:
        interceptors = []
        if self.settings.swarm_token:
            verifier = auth.Verifier(self.settings.swarm_token, audiences=[self.peer_id], keys=self.peer_key)
            interceptors = [auth.ServerAuth(verifier), limits.ServerLimits()]
        self._server = grpc.aio.server(options=GRPC_OPTIONS + limits.SERVER_OPTIONS, interceptors=interceptors)
        wgrpc.add_StageServicer_to_server(StageService(self), self._server)
        port = tls.add_port(self._server, f"{self.settings.host}:{self.settings.port}", self.settings.tls)
        if port == 0:
            raise OSError(f"cannot listen on {self.settings.host}:{self.settings.port}")
        await self._server.start()
        self.endpoint = grpc_target_to_multiaddr(f"{self.settings.announce or self.settings.host}:{port}")
        via = f" over TLS, certificate {self.settings.tls.fingerprint}" if self.settings.tls else ""
        log.info("stage service listening on %s%s", self.endpoint, via)
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
            reachable = await self._unless_stopped(self._check_reachable(plan))
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
            return await self._session(ControlAddress.of(self.plan))
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
            async with await self.control_channel(ControlAddress.of(plan)) as ch:
                reply = await cgrpc.ControlStub(ch).DialBack(cpb.DialBackRequest(endpoint=endpoint), timeout=15)
            reachable, detail = reply.reachable, reply.detail
        except (grpc.aio.AioRpcError, tls.TlsError) as e:
            reachable, detail = True, f"could not check ({failure_detail(e)}); assuming reachable"
            log.warning("reachability check: %s", detail)
        finally:
            await probe.stop(grace=None)
        self.settings = dataclasses.replace(self.settings, port=port)  # keep the port that was checked
        if not reachable:
            log.warning("not reachable from outside (%s): this peer will dial its neighbours", detail)
            await self.discovery.restart_as_client()
        return reachable

    async def _measure(self, plan: Plan, reachable: bool = True) -> PeerRecord:
        throughput = await self.run_compute(planned_throughput, plan, self.device, self.settings.hf_path)
        try:
            up, down = await measure_bandwidth(await self.control_channel(ControlAddress.of(plan)))
        except tls.TlsError as e:
            log.warning("could not measure the link to the coordinator: %s", e)
            up, down = 0.0, 0.0
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
            tls_fingerprint=self.settings.tls.fingerprint if self.settings.tls else "",
        )

    async def _session(self, coordinator: ControlAddress) -> int:
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
            except (grpc.aio.AioRpcError, tls.TlsError) as e:
                if self.stopping.is_set():
                    return 0
                if not ever_attached and not self._attached:
                    log.error("lost the coordinator at %s: %s", coordinator, failure_detail(e))
                    return 2
                if self._attached:  # a new outage starts now
                    self._attached, ever_attached, lost_at, delay = False, True, time.monotonic(), 0.5
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
        channel = await self.control_channel(coordinator)  # TLS: checks the pin before anything is sent
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
                elif kind == "update":
                    await self._on_update(command.update)
                elif kind == "stop_training":
                    if self.driver is not None:
                        self.driver.stop_after_step()
                elif kind == "collect_state":
                    if command.collect_state.checkpoint:
                        runner, generation = self.runner, self.generation
                        version, (weights, optim) = runner.version, await self.run_compute(runner.checkpoint_state)
                        await self._upload_checkpoint(version, weights, optim, generation=generation)
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
            epoch=a.epoch,
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
        for link in [*self.upstreams.values(), *self.downstreams.values()]:
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
        self.bounds = link_bounds(model_cfg, train_cfg)
        self.policy = wire_policy(
            train_cfg.wire_forward,
            train_cfg.wire_backward,
            self.settings.poison,
            self.settings.poison_after,
            lambda: self.runner.version if self.runner is not None else 0,
            error_feedback=train_cfg.error_feedback_backward,
        )
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
            "assigned stage %d/%d: layers [%d, %d) on %s; wire %s forward, %s backward (error feedback %s)",
            a.stage,
            a.num_stages,
            a.layer_start,
            a.layer_end,
            self.device,
            self.policy.forward,
            self.policy.backward,
            "on" if self.policy.error_feedback else "off",
        )
        if self.runner.is_first:
            self.driver = Driver(self, train_cfg, model_cfg, hf)
            await self.run_compute(self.driver.load_data)
        ups, downs, replicas = neighbours(a)
        self._setup_replicas(a, train_cfg, ups, downs, replicas)
        self._dial_tasks = []
        if not a.accept_downstream:
            for peer, endpoint in downs.items():
                self._dial_tasks.append(asyncio.create_task(self._dial(self.generation, "downstream", peer, endpoint)))
        if a.dial_upstream:  # we are behind NAT: we open the links to our upstream holders
            for peer, endpoint in ups.items():
                self._dial_tasks.append(asyncio.create_task(self._dial(self.generation, "upstream", peer, endpoint)))
        self._tasks.extend(self._dial_tasks)
        if downs:  # dialled by us, or by downstream peers behind NAT
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
        for link in [*self.upstreams.values(), *self.downstreams.values()]:
            link.close()
        self.upstreams, self.downstreams = {}, {}
        self.downstream_ready = asyncio.Event()
        self.router = self.split = self.shares = self.group = None
        self._origin.clear()
        self._sent.clear()
        self.assigned.clear()
        self.assignment = None
        self.runner = None
        self.sanity = LinkSanity(DAEMON_SETTINGS, self.sanity.quarantine)  # new neighbours, new norms

    async def _restore(self, version: int) -> None:
        """Load this block's weights and optimizer state at ``version`` from the coordinator's store."""
        request = cpb.FetchStateRequest(peer_id=self.peer_id, version=version, names=self.runner.parameter_names())
        own = await self.run_compute(self.runner.state_dict)
        spec = BlockSpec({name: tuple(t.shape) for name, t in own.items()})  # only our block's state is accepted
        reasm = Reassembler(max_packet_bytes=spec.max_state_bytes, message_type=cpb.StateChunk)
        chunk = None
        try:
            async for frame in self._control.FetchState(request, timeout=120):
                chunk = reasm.push(frame) or chunk
            if chunk is None:
                raise AssignmentError(f"the coordinator sent no state for version {version}")
            weights, optim = await asyncio.to_thread(decode_state, chunk, spec)
        except WireError as e:
            raise AssignmentError(f"the coordinator's state for version {version} is not this block's: {e}") from None
        await self.run_compute(self.runner.restore, version, weights, optim)
        digest = await asyncio.to_thread(state_digest, weights, optim)
        log.info("restored %d tensors at weight version %d (state digest %s)", len(weights), version, digest)

    async def _upload_checkpoint(self, version: int, weights: dict, optim: dict, *, generation: int) -> None:
        """Upload a checkpoint taken under assignment ``generation``; never once that assignment is gone
        (the coordinator would refuse it anyway: its plan epoch is over)."""
        a = self.assignment
        if a is None or self._control is None or generation != self.generation:
            return
        if crash_due(self.settings.crash_at_checkpoint, a.stage, generation, version):
            log.error("--debug-crash-at-checkpoint: dying instead of uploading checkpoint v%d", version)
            os._exit(3)

        def build() -> cpb.StateChunk:
            chunk = cpb.StateChunk(
                peer_id=self.peer_id,
                stage=a.stage,
                version=version,
                layer_start=a.layer_start,
                layer_end=a.layer_end,
                periodic=True,
                epoch=a.epoch,
            )
            for name, t in weights.items():
                chunk.tensors.add(name=name, tensor=tensor_to_pb(t.float(), "fp32"))
            for name, t in optim.items():
                chunk.optimizer.add(name=name, tensor=tensor_to_pb(t.float(), "fp32"))
            return chunk

        chunk = await asyncio.to_thread(build)
        if generation != self.generation:
            log.info("checkpoint v%d dropped: re-assigned while it was being packed", version)
            return

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
        await self.final_average()
        await self.report()  # final stats reach the coordinator before the state does (its summary uses them)
        from swarm.wire import tensor_to_pb

        state = await self.run_compute(self.runner.state_dict)
        a = self.assignment  # the block is named, so the coordinator can check it is ours (coordinator/call_checks.py)
        chunk = cpb.StateChunk(peer_id=self.peer_id, stage=a.stage, layer_start=a.layer_start, layer_end=a.layer_end)
        for name, tensor in state.items():
            chunk.tensors.add(name=name, tensor=tensor_to_pb(tensor.float(), "fp32"))

        async def frames():
            for frame in split_packet(chunk, 1):
                yield frame

        reply = await self._patiently(lambda: self._control.UploadState(frames()))
        log.info("uploaded %d tensors of stage %d", reply.tensors, self.assignment.stage)

    async def _patiently(self, call, attempts: int = 6):
        """A unary call to the coordinator that its per-sender rate limit may refuse for a moment: retry
        RESOURCE_EXHAUSTED with backoff, so a busy moment is not mistaken for a lost coordinator."""
        delay = 0.2
        for attempt in range(attempts):
            try:
                return await call()
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == attempts - 1:
                    raise
            await asyncio.sleep(delay)
            delay *= 2

    # ---- links ----------------------------------------------------------------------------------
    def hello(self) -> pb.Packet:
        a = self.assignment
        return hello_packet(self.peer_id, a.stage if a else 0, a.run_id if a else "", PROTOCOL_VERSION)

    async def _dial(self, generation: int, side: str, peer: str, endpoint: str) -> None:
        """Open the link to a neighbour (``side``: "downstream" normally, "upstream" when we are behind NAT)."""
        target = multiaddr_to_grpc_target(endpoint)
        link = Link(f"{self.peer_id}->{peer}")
        try:
            channel = await self._stage_channel(target, peer)
        except tls.TlsError as e:
            await self._link_failed(generation, f"refusing to link to {side} {peer} at {target}: {e}")
            return
        call = wgrpc.StageStub(channel).Link()
        try:
            for frame in split_packet(self.hello(), 0):
                await call.write(frame)
            hello = await read_hello(call, link, self.settings.link_timeout)
            if hello.peer_id != peer:
                raise WireError(f"expected {side} peer {peer}, reached {hello.peer_id}")
            if generation != self.generation:
                return
            self.attach(side, peer, link)
            link.bound_packets(self.bounds.max_packet_bytes)
            await link.run(call, self.on_packet)
            await self.link_closed(generation, side, peer, link, f"{side} peer {peer} closed the link")
        except (WireError, StageInputError) as e:
            self.refused += 1
            await refuse_client_stream(call, link, str(e))
            await self.link_closed(generation, side, peer, link, f"refused a packet from {side} {peer}: {e}")
        except (TimeoutError, grpc.aio.AioRpcError, LinkClosed) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            await self.link_closed(generation, side, peer, link, f"link to {side} {peer} at {target} failed: {detail}")
        except Exception as e:  # a bug, not bad input: say so loudly, and let the coordinator recover
            log.exception("link to %s %s failed", side, peer)
            await self.link_closed(generation, side, peer, link, f"link to {side} {peer} failed: {e!r}")
        finally:
            await channel.close()

    def attach(self, side: str, peer: str, link: Link) -> None:
        """A link to a neighbour is up (dialled by us or accepted): it replaces any older one to that peer."""
        table = self.downstreams if side == "downstream" else self.upstreams
        old = table.get(peer)
        if old is not None and old is not link and not old.closed.is_set():
            old.close()
        table[peer] = link
        if side == "downstream" and self.assignment_downstreams() <= set(self.downstreams):
            self.downstream_ready.set()

    def assignment_downstreams(self) -> set[str]:
        return set(neighbours(self.assignment)[1]) if self.assignment is not None else set()

    async def link_closed(
        self, generation: int, side: str, peer: str, link: Link, reason: str, *, report: bool = True
    ) -> None:
        """A neighbour's link ended. A vanished replica is routed around; a lost only neighbour is a fault."""
        table = self.downstreams if side == "downstream" else self.upstreams
        if table.get(peer) is link:
            del table[peer]
        if generation != self.generation or self.stopping.is_set():
            return
        if table.get(peer) is not None:  # it dialled again: the new link replaced this one
            return
        if table and not (side == "downstream" and self.router is None):
            log.warning("%s; %d other holder(s) of that block remain: routing around it", reason, len(table))
            if side == "downstream":
                await self._lose_downstream(peer)
            elif self.shares is not None:
                await self._expect_shares(self.shares.remove(peer))
            return
        if report:
            await self.fail(reason)

    async def _stage_channel(self, target: str, peer: str) -> grpc.aio.Channel:
        """A channel to ``peer``'s Stage service: TLS pinned to the fingerprint the signed plan gives it,
        or in clear when the plan gives none (that peer serves without TLS)."""
        planned = [p for st in (self.plan.stages if self.plan else []) for p in st.peers if p.peer_id == peer]
        pin = planned[0].tls_fingerprint if planned else ""
        if not pin:
            return self.channel(target, peer)
        token = self.settings.swarm_token
        interceptors = auth.client_interceptors(token, self.peer_id, peer, signer=self.signing_key) if token else None
        channel = await tls.dial_pinned(
            target, pin, options=GRPC_OPTIONS, interceptors=interceptors, timeout=self.settings.link_timeout
        )
        log.info("linking to %s over TLS, certificate pinned to %s", peer, pin)
        return channel

    async def _link_failed(self, generation: int, reason: str) -> None:
        """Report a broken link, unless it belonged to an assignment that was already replaced."""
        if generation == self.generation and not self.stopping.is_set():
            await self.fail(reason)

    async def _lose_downstream(self, peer: str) -> None:
        """A downstream replica vanished: its micro-batches will never come back; drop and count them."""
        if self.router is None:
            return
        lost = self.router.remove(peer)
        if self.split is not None:
            self.split.remove(peer)
        self.lost_micro_batches += len(lost)
        for mb_id in lost:
            mb = self._sent.pop(mb_id, None)
            if mb is not None:
                await self._on_gradients(pb.Gradients(mb=mb, dropped=True), None)

    async def on_packet(self, link: Link, packet: pb.Packet) -> None:
        """Route one packet from a neighbour; raises WireError/StageInputError for bad input."""
        kind = packet.WhichOneof("body")
        if self.runner is None:
            raise WireError("this peer has no block assigned yet")
        sender = link.remote.peer_id if link.remote is not None else ""
        self.bounds.check_packet(packet)  # every tensor fits this block, before anything is decoded
        if kind == "activations":
            if self.upstreams.get(sender) is not link:
                raise WireError("activations may only come from an upstream neighbour")
            await self._on_activations(packet.activations, sender)
        elif kind == "gradients":
            if self.downstreams.get(sender) is not link:
                raise WireError("gradients may only come from a downstream neighbour")
            await self._on_gradients(packet.gradients, sender)
        elif kind == "step_end":
            if self.upstreams.get(sender) is not link:
                raise WireError("step markers may only come from an upstream neighbour")
            if self.shares is None:
                raise WireError("step marker sent to a stage that sees every micro-batch (no replicas before it)")
            try:
                ready = self.shares.marker(packet.step_end.step, sender, packet.step_end.count)
            except ValueError as e:
                raise WireError(str(e)) from None
            await self._expect_shares(ready)
        elif kind == "hello":
            raise WireError("unexpected second hello on an open link")
        else:
            raise WireError(f"unexpected packet kind {kind!r}")

    async def _expect_shares(self, ready: list[tuple[int, int]]) -> None:
        """This replica's share of some steps is now known: its optimizer may step, its markers go on."""
        runner = self.runner
        for step, share in ready:
            if self.split is not None:
                self.split.expect(step, share)
            await self.run_compute(runner.expect, share, priority=BACKWARD)
        await self._send_step_ends()

    async def _send_step_ends(self) -> None:
        if self.split is None:
            return
        for step, counts in self.split.complete():
            for peer, count in counts.items():
                link = self.downstreams.get(peer)
                if link is not None and not link.closed.is_set():
                    try:
                        await link.send(pb.Packet(step_end=pb.StepEnd(step=step, count=count)))
                    except LinkClosed:
                        pass  # that holder is gone; its upstream-loss handling covers the step

    async def send_down(self, packet: pb.Packet) -> None:
        """Send activations to one holder of the next block: the one expected to finish it first."""
        mb = packet.activations.mb
        peer = self.router.choose()
        self.router.sent(peer, mb.id)
        self._sent[mb.id] = mb
        try:
            await self.downstreams[peer].send(packet)
        except (KeyError, LinkClosed):  # vanished between choice and send: its link handling drops it
            pass
        if self.split is not None and not mb.eval:
            self.split.forwarded(mb.step, peer)
            await self._send_step_ends()

    async def send_up(self, packet: pb.Packet) -> None:
        """Send a gradient (or an eval loss) back to exactly the holder that sent us its forward."""
        peer = self._origin.pop(packet.gradients.mb.id, None)
        link = self.upstreams.get(peer) if peer is not None else None
        if link is None or link.closed.is_set():
            return  # that upstream holder vanished; our own weights already have this gradient
        try:
            await link.send(packet)
        except LinkClosed:
            pass

    async def _on_activations(self, act: pb.Activations, sender: str) -> None:
        generation = self.generation
        self._origin[act.mb.id] = sender
        packet = await self.run_compute(self._forward_job, act, self.runner, sender, priority=FORWARD)
        if generation != self.generation:  # re-assigned meanwhile: this micro-batch belongs to the old plan
            return
        if packet.WhichOneof("body") == "activations":
            await self.send_down(packet)
        else:
            await self.send_up(packet)

    def _slow(self, runner: StageRunner) -> None:
        if self.settings.slowdown:
            time.sleep(self.settings.slowdown)
        if self.settings.slow_stage is not None and self.assignment is not None:
            stage, seconds = self.settings.slow_stage
            if self.assignment.stage == stage:
                time.sleep(seconds)

    def _forward_job(self, act: pb.Activations, runner: StageRunner, sender: str = "") -> pb.Packet:
        if not act.mb.eval:
            self._slow(runner)
        x = self.policy.decode(act.hidden)
        targets = self.policy.decode(act.targets) if act.HasField("targets") else None
        if not self.plausible(x, sender, "activations"):  # dropped: upstream drops it too, nothing waits
            return pb.Packet(gradients=pb.Gradients(mb=act.mb, dropped=True))
        result = runner.forward(act.mb.id, x, targets, train=not act.mb.eval)
        shares = self.shares
        if shares is not None and not act.mb.eval:
            shares.received(act.mb.step, sender)
        if result.output is not None:
            mb = pb.MicroBatch()
            mb.CopyFrom(act.mb)
            mb.weight_version = runner.version
            return self._own_output(
                act.mb, lambda: self.policy.activations(mb, result.output, targets), runner, pending=not act.mb.eval
            )
        return self._own_output(
            act.mb,
            lambda: self.policy.gradients(act.mb, result.input_grad, result.loss_sum, result.tokens, to=sender),
            runner,
        )

    def _own_output(
        self, mb: pb.MicroBatch, encode, runner: StageRunner, *, pending: bool = False, **dropped
    ) -> pb.Packet:
        """Encode this stage's own result. If that fails, the fault is ours, not the sender's (its input passed
        every check): say so, and drop the micro-batch (``pending``: free its graph here) so nothing waits."""
        try:
            return encode()
        except WireError as e:
            log.error("cannot encode this stage's own output for micro-batch %d: %s; dropped", mb.id, e)
            if pending:
                runner.backward(mb.id, None)
            return pb.Packet(gradients=pb.Gradients(mb=mb, dropped=True, **dropped))

    async def _on_gradients(self, g: pb.Gradients, sender: str | None) -> None:
        if self.router is not None and sender is not None:
            self.router.returned(g.mb.id)
        self._sent.pop(g.mb.id, None)
        if self.driver is not None:
            await self.driver.on_gradients(g)
            return
        generation = self.generation
        packet = await self.run_compute(self._backward_job, g, self.runner, sender or "", priority=BACKWARD)
        if generation == self.generation:
            await self.send_up(packet)

    def _backward_job(self, g: pb.Gradients, runner: StageRunner, sender: str = "") -> pb.Packet:
        if g.mb.eval:
            packet = self.policy.gradients(g.mb, None, g.loss_sum, g.tokens, to="")
            packet.gradients.dropped = g.dropped
            return packet
        grad = None if g.dropped else self.policy.decode(g.grad)
        if grad is not None:
            self._slow(runner)
        if grad is not None and not self.plausible(grad, sender, "gradients"):
            grad = None  # dropped here and, through the dropped packet, upstream
        result = runner.backward(g.mb.id, grad)
        if result.dropped:
            return pb.Packet(gradients=pb.Gradients(mb=g.mb, dropped=True, loss_sum=g.loss_sum, tokens=g.tokens))
        origin = self._origin.get(g.mb.id, "")  # the upstream holder that sent this micro-batch: its residual
        return self._own_output(
            g.mb,
            lambda: self.policy.gradients(g.mb, result.input_grad, g.loss_sum, g.tokens, to=origin),
            runner,
            loss_sum=g.loss_sum,
            tokens=g.tokens,
        )

    # ---- replicas -------------------------------------------------------------------------------
    def _setup_replicas(self, a: cpb.Assignment, train_cfg, ups: dict, downs: dict, replicas: dict) -> None:
        """Routing towards the next block, step shares and averaging when blocks have several holders."""
        self.router = ReplicaRouter(list(downs)) if downs else None
        replicated = len(replicas) > 1
        partial = replicated or len(ups) > 1  # not every micro-batch passes here: count shares from markers
        if downs and (len(downs) > 1 or replicated):  # the next stage counts shares: tell it ours
            self.split = SenderSplit(list(downs), fixed=None if partial else train_cfg.micro_batches)
        if partial:
            self.runner.use_quotas()
            self.shares = UpstreamShares(list(ups))
        if not replicated:
            return
        if a.stage == 0:
            raise AssignmentError("the first block (the data source) cannot have replicas")
        self.runner.start_averaging()
        self.anchor_digest = self.runner.anchor_digest()
        self.group = AverageGroup(
            self.peer_id,
            {p: multiaddr_to_grpc_target(e) for p, e in replicas.items()},
            run_id=a.run_id,
            layers=(a.layer_start, a.layer_end),
            shapes={n: tuple(t.shape) for n, t in self.runner.anchor.items()},
            codec=train_cfg.average_codec,
            timeout=train_cfg.average_timeout,
            channel=self._stage_channel,
            generation=self.generation,
            sanity=self.sanity,  # a lying replica is charged and quarantined like a poisoning neighbour
        )
        self._tasks.append(asyncio.create_task(self._average_loop(self.generation, train_cfg), name="average"))

    async def _on_update(self, a: cpb.Assignment) -> None:
        """Same block, fewer neighbours or replicas (one left): forget the gone ones, keep training."""
        current = self.assignment
        if current is None or (a.stage, a.layer_start, a.layer_end, a.run_id, a.epoch) != (
            current.stage,
            current.layer_start,
            current.layer_end,
            current.run_id,
            current.epoch,
        ):
            raise AssignmentError("an update must keep this peer's block; the coordinator sent another")
        await self._check_against_plan(a)
        ups, downs, replicas = neighbours(a)
        generation = self.generation
        for peer in [p for p in self.downstreams if p not in downs]:
            link = self.downstreams[peer]
            link.close()
            await self.link_closed(generation, "downstream", peer, link, f"{peer} left the plan", report=False)
        for peer in [p for p in self.upstreams if p not in ups]:
            link = self.upstreams[peer]
            link.close()
            await self.link_closed(generation, "upstream", peer, link, f"{peer} left the plan", report=False)
        if self.router is not None:
            for peer in [p for p in self.router.peers if p not in downs]:
                await self._lose_downstream(peer)
        if self.shares is not None:
            for peer in [p for p in self.shares.upstreams if p not in ups]:
                await self._expect_shares(self.shares.remove(peer))
        if self.group is not None and len(replicas) > 1:
            self.group.set_members({p: multiaddr_to_grpc_target(e) for p, e in replicas.items()})
        elif self.group is not None:  # the last other replica left: nothing to average with any more
            log.info("no other replica of layers [%d, %d) is left: averaging stops", a.layer_start, a.layer_end)
            self.group = None
        self.assignment = a
        log.info("plan updated: upstream %s, downstream %s, replicas %s", sorted(ups), sorted(downs), sorted(replicas))

    async def _average_loop(self, generation: int, train_cfg) -> None:
        """Every T local steps, average this block's change with its replicas, in the background."""
        every = train_cfg.average_every
        next_round = 1
        while generation == self.generation and not self.stopping.is_set():
            runner = self.runner
            if runner is None or runner.version < next_round * every:
                self._stepped.clear()
                await self._stepped.wait()
                continue
            async with self._avg_lock:
                if generation != self.generation:
                    return
                next_round = runner.version // every
                await self._average_round(next_round, generation, train_cfg)
            next_round += 1

    async def _average_round(self, number: int, generation: int, train_cfg) -> bool:
        runner, group = self.runner, self.group
        if group is None or runner is None:
            return False
        own = await self.run_compute(runner.average_delta, priority=BACKWARD)
        result = await group.contribute(number, own)
        if result is None or generation != self.generation:
            return False
        average, contributors = result

        def apply() -> str:
            runner.apply_average(average, own, train_cfg.outer_lr, train_cfg.outer_momentum)
            return runner.anchor_digest()

        self.anchor_digest = await self.run_compute(apply, priority=BACKWARD)
        group.rounds_applied += 1
        log.info(
            "average round %d applied (%s); agreed parameters %s", number, ", ".join(contributors), self.anchor_digest
        )
        return True

    async def final_average(self) -> None:
        """At the end of a run: one last round with training stopped, so every replica holds the same weights."""
        if self.group is None or self.runner is None:
            return
        async with self._avg_lock:
            await self._average_round(FINAL_ROUND + self.runner.version, self.generation, self._train_cfg())

    def _train_cfg(self):
        return assignment_configs(self.assignment)[1]

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

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> cpb.StageStats:
        links = [*self.upstreams.values(), *self.downstreams.values()]
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
            average_rounds=self.group.rounds_applied if self.group else 0,
            average_bytes=self.group.bytes if self.group else 0,
            anchor_digest=self.anchor_digest,
            lost_micro_batches=self.lost_micro_batches,
            rejected=sum(self.sanity.rejections.values()),
            rejected_by_sender=dict(self.sanity.rejections),
        )

    async def report(self, **fields) -> None:
        """Send our stats; a report that carries more (steps, evals, ready, finished, an error, leaving) is
        kept until the coordinator has it, and sent before anything newer, also across a coordinator restart."""
        stats = self.stats()
        self.metrics.update(stats)
        quarantined = [cpb.Quarantined(peer_id=p, reason=why) for p, why in self.sanity.quarantine.status().items()]
        msg = cpb.StatusReport(peer_id=self.peer_id, stats=stats, quarantined=quarantined, **fields)
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
