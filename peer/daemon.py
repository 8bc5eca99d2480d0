"""The peer daemon: the lifecycle of one ``ravn-peer`` process, and nothing else.

Start the DHT (before any gRPC thread: hivemind forks), find the swarm and its signed plan, check that
the coordinator can dial us back (else we are behind NAT), start the Stage server, measure and
announce ourselves, wait for a plan that gives us a block, then hand over to the :class:`Session` until
the coordinator releases us; close everything on the way out. The block's work lives in
:class:`peer.stage.Stage`, the coordinator session in :mod:`peer.session`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
import torch

from peer.compute import OTHER, ComputeWorker
from peer.control_channel import Channels, ControlAddress, failure_detail
from peer.discovery import Discovery, DiscoveryError
from peer.faults import Faults
from peer.plan_trust import PlanTrust
from peer.probe import measure_bandwidth
from peer.session import SOFTWARE_VERSION, Session
from peer.settings import PeerSettings
from peer.stage import Stage
from peer.stage_service import StageHost, StageService
from swarm.config import PROTOCOL_VERSION
from swarm.dht.keys import load_public_key
from swarm.dht.multiaddrs import grpc_target_to_multiaddr
from swarm.dht.schema import PeerRecord, Plan
from swarm.dht.signing import new_key
from swarm.metrics import MetricsServer
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.security import auth, limits, tls
from swarm.train.measure import device_name, free_memory_bytes, planned_throughput
from swarm.wire.transport import GRPC_OPTIONS

__all__ = ["PeerDaemon", "PeerSettings"]
log = logging.getLogger(__name__)


class PeerDaemon:
    """Starts, serves and closes one peer; the coordinator session and the block are the Session's."""

    def __init__(
        self, settings: PeerSettings, discovery: Discovery | None = None, faults: Faults | None = None
    ) -> None:
        self.settings, self.discovery, self.faults = settings, discovery, faults or Faults()
        self.peer_id = settings.peer_id
        self.device = settings.resolved_device()
        # the key of this process's DHT record; every call it makes is signed with it (swarm/security/identity.py)
        self.signing_key = discovery.signing_key if discovery is not None else new_key()
        self.metrics_server = MetricsServer()
        self.metrics = self.metrics_server.peer(settings.peer_id)
        self.compute = ComputeWorker()
        self.stopping = asyncio.Event()
        self.endpoint = ""
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self.channels = Channels(self.peer_id, settings.swarm_token, self.signing_key, settings.link_timeout)
        self.session = Session(
            settings, self.faults, self._trust(), self.channels, self.compute, self.metrics, self.stopping, discovery
        )

    def _trust(self) -> PlanTrust:
        """Whose plans this peer obeys: discovery's pinned coordinator key, else the one in the settings."""
        if self.discovery is not None:
            return PlanTrust(self.discovery.trusted_key, self.discovery.s.swarm, self.peer_id)
        if not self.settings.coordinator_key:
            raise ValueError("a peer without discovery needs settings.coordinator_key: it obeys only signed plans")
        return PlanTrust(load_public_key(self.settings.coordinator_key), self.settings.swarm, self.peer_id)

    @property
    def stage(self) -> Stage | None:
        """The Stage of the current assignment (None before the first)."""
        return self.session.stage

    async def run_compute(self, fn, *args, priority: int = OTHER):
        """Run ``fn`` on this peer's compute thread (the current Stage's, when it has one)."""
        if self.stage is not None:
            return await self.stage.compute(fn, *args, priority=priority)
        return await self.compute.run(fn, *args, priority=priority)

    def stage_host(self) -> StageHost:
        """What the Stage service may ask of this peer (and nothing more)."""
        session = self.session
        return StageHost(
            peer_id=self.peer_id,
            swarm_token=self.settings.swarm_token,
            link_timeout=self.settings.link_timeout,
            peer_key=session.peer_key,
            stage=session.wait_stage,
            current=lambda: session.stage,
        )

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start_server(self) -> str:
        interceptors = []
        session = self.session
        if self.settings.swarm_token:
            verifier = auth.Verifier(self.settings.swarm_token, audiences=[self.peer_id], keys=session.peer_key)
            interceptors = [auth.ServerAuth(verifier), limits.ServerLimits()]
        self._server = grpc.aio.server(options=GRPC_OPTIONS + limits.SERVER_OPTIONS, interceptors=interceptors)
        wgrpc.add_StageServicer_to_server(StageService(self.stage_host()), self._server)
        port = tls.add_port(self._server, f"{self.settings.host}:{self.settings.port}", self.settings.tls)
        if port == 0:
            raise OSError(f"cannot listen on {self.settings.host}:{self.settings.port}")
        await self._server.start()
        self.endpoint = grpc_target_to_multiaddr(f"{self.settings.announce or self.settings.host}:{port}")
        session.endpoint = self.endpoint
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
            plan = await self._unless_stopped(disc.wait_for_block(self.peer_id, self.settings.plan_timeout))
            self.session.plan = plan
            return await self.session.run(ControlAddress.of(plan))
        except DiscoveryError as e:
            log.error("%s", e)
            return 2
        except asyncio.CancelledError:
            return 0
        finally:
            await self.close()

    def request_leave(self) -> None:
        """First Ctrl-C/SIGTERM: leave gracefully (see Session.request_leave); the second: go now."""
        self.session.request_leave()

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
            async with await self.channels.coordinator(ControlAddress.of(plan)) as ch:
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
            up, down = await measure_bandwidth(await self.channels.coordinator(ControlAddress.of(plan)))
        except tls.TlsError as e:
            log.warning("could not measure the link to the coordinator: %s", e)
            up, down = 0.0, 0.0
        if self.faults.uplink_mbit:  # testing: a home uplink, as the planner will see it
            up = self.faults.uplink_mbit * 1e6 / 8
        return PeerRecord(
            peer_id=self.peer_id,
            endpoint=self.endpoint,
            device=device_name(self.device),
            free_memory_bytes=self.settings.offered_memory(free_memory_bytes(self.device)),
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

    async def close(self) -> None:
        self.stopping.set()
        await self.session.close()  # the Stage first: nothing of it acts while the rest goes
        self.metrics_server.stop()
        if self.discovery is not None:
            try:
                await asyncio.wait_for(self.discovery.leave(), 10)
            except Exception as e:  # noqa: BLE001 - leaving is best effort; the record expires anyway
                log.warning("could not withdraw this peer's record: %s", e)
            self.discovery.shutdown()
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await asyncio.to_thread(self.compute.close)
