"""One training run as the coordinator sees it: the parts, composed, and the loop that drives them.

The coordinator is the only place that decides: which block each peer holds (``planning.py``), when
training starts and stops, and what happens when a peer fails (``recovery.py``). Peers only report
(``reports.py``); they never talk to the coordinator about each other. ``SwarmRun`` builds the parts,
serves Control over gRPC (``control_service.py``, handed a few callables), and runs the state machine of
``run_flow.py``: gathering → planning → training ⇄ recovering → collecting → done.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import grpc

from coordinator import upload_checks
from coordinator.call_checks import checkpoint_window
from coordinator.checkpoint_store import CheckpointStore
from coordinator.control_service import ControlHandlers, ControlService
from coordinator.membership import Membership
from coordinator.planning import Planning
from coordinator.progress import Progress
from coordinator.recovery import Recovery
from coordinator.reports import ReportIntake
from coordinator.roster import Roster
from coordinator.run_flow import Phase, RunFlow
from coordinator.run_record import RunRecord
from coordinator.run_settings import NoPlanFits, RunFailed, RunSettings
from coordinator.run_state import CoordinatorState
from coordinator.run_status import swarm_status
from coordinator.sessions import Sessions
from coordinator.status_data import SwarmStatus
from swarm.dht.multiaddrs import grpc_target_to_multiaddr
from swarm.dht.schema import Plan
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.security import auth, limits, tls
from swarm.wire.state_checks import BlockSpec
from swarm.wire.transport import GRPC_OPTIONS

RESUME_TIMEOUT = 120.0  # a restarted coordinator waits this long for its peers to re-attach (they redial for 60 s)


class SwarmRun:
    def __init__(
        self,
        settings: RunSettings,
        membership: Membership,
        progress: Progress | None = None,
        resume: CoordinatorState | None = None,
    ) -> None:
        self.s = settings
        self.membership = membership
        self.run_id = settings.name
        self.progress = progress or Progress(total_steps=settings.train.steps)
        self.store = CheckpointStore(settings.run_dir / "checkpoints", settings.model.n_layers)
        self.flow = RunFlow()
        self.planning = Planning(settings, membership, self.progress, self.store)
        self.sessions = Sessions(self.planning, self.flow, membership, self.progress, self.store)
        self.record = RunRecord(settings, membership, self.planning, self.flow, self.store, self.progress)
        self.roster = Roster(
            settings,
            membership,
            self.planning,
            self.sessions,
            self.flow,
            self.record,
            self.progress,
            resumed=resume is not None,
        )
        self.recovery = Recovery(
            settings,
            membership,
            self.planning,
            self.sessions,
            self.roster,
            self.flow,
            self.record,
            self.store,
            self.progress,
        )
        self.reports = ReportIntake(settings, self.sessions, self.flow, self.record, self.progress)
        self._server: grpc.aio.Server | None = None
        self._resume = resume
        if resume is not None:
            self.planning.load(resume)
            self.record.load(resume)

    # ---- what the outside sees ------------------------------------------------------------------
    def status(self) -> SwarmStatus:
        """The swarm as `ravn status` shows it: run progress, each peer, each block."""
        return swarm_status(
            self.s, self.planning, self.sessions, self.record, self.flow, self.progress, self.membership.s.heartbeat
        )

    def checkpoint_window(self) -> tuple[int, int]:
        """The versions a periodic checkpoint may carry now (see coordinator/call_checks.py)."""
        t = self.s.train
        return checkpoint_window(
            self.planning.restore_version, self.record.last_step, t.steps, t.checkpoint_every, t.staleness_bound
        )

    def peer_failed(self, peer_id: str, reason: str) -> None:
        """A peer process died (seen by its launcher, ``ravn local``)."""
        self.recovery.peer_failed(peer_id, reason)

    def request_stop(self) -> None:
        """Ctrl-C: finish the current step, save what we have, release everyone."""
        self.flow.request_stop()

    # ---- serving Control ------------------------------------------------------------------------
    def control_handlers(self) -> ControlHandlers:
        """The calls the Control service may make (and nothing else of the run)."""
        s, planning, sessions, record = self.s, self.planning, self.sessions, self.record

        def upload_limit() -> int:
            return upload_checks.max_upload_bytes(s.model, s.hf, [(a, b) for a, b, _ in planning.planned.values()])

        def upload_spec(chunk: cpb.StateChunk) -> BlockSpec:
            return upload_checks.block_spec(s.model, s.hf, chunk, planning.block(chunk.peer_id))

        return ControlHandlers(
            swarm_token=s.swarm_token,
            peer_key=planning.peer_key,
            register=sessions.register,
            lost=self.recovery.peer_lost,
            known=sessions.known,
            on_report=self.reports.on_report,
            held_block=sessions.held_block,
            checkpoint_window=self.checkpoint_window,
            upload_limit=upload_limit,
            upload_spec=upload_spec,
            on_checkpoint=record.on_checkpoint,
            on_state=lambda peer_id, stage, tensors: record.on_state(peer_id, stage, tensors, sessions.peers),
            fetch_state=self.store.fetch,
            status=lambda: self.status().to_dict(),
        )

    async def start_server(self) -> int:
        interceptors = []
        if self.s.swarm_token:
            verifier = auth.Verifier(
                self.s.swarm_token, audiences=[auth.COORDINATOR_AUDIENCE], keys=self.planning.peer_key
            )
            interceptors = [auth.ServerAuth(verifier), limits.ServerLimits(limits.LimitSettings(inflight_per_sender=8))]
        self._server = grpc.aio.server(options=GRPC_OPTIONS + limits.SERVER_OPTIONS, interceptors=interceptors)
        cgrpc.add_ControlServicer_to_server(ControlService(self.control_handlers()), self._server)
        port = tls.add_port(self._server, f"{self.s.host}:{self.s.port}", self.s.tls)
        if port == 0:
            raise RunFailed(f"cannot listen on {self.s.host}:{self.s.port}; is the port in use?")
        self.record.port = port
        await self._server.start()
        if self.s.metrics_port is not None:
            metrics_port = self.record.metrics_server.start(self.s.metrics_port, self.s.metrics_host)
            self.progress.message(f"Prometheus metrics on http://{self.s.metrics_host}:{metrics_port}/metrics")
        self.planning.control_endpoint = grpc_target_to_multiaddr(f"{self.s.announce or self.s.host}:{port}")
        return port

    async def stop_server(self) -> None:
        self.record.metrics_server.stop()
        if self._server is not None:
            await self._server.stop(grace=2.0)
        self.record.artifacts.close()

    # ---- the run --------------------------------------------------------------------------------
    async def run(self) -> int:
        """Drive the run to its end; returns the process exit code."""
        s, flow, roster, record = self.s, self.flow, self.roster, self.record
        record.artifacts.write_config(
            s.model,
            s.train,
            {"run_id": self.run_id, "peers": s.peers, "swarm": s.swarm, "hf": asdict(s.hf) if s.hf else None},
        )
        code = 0
        background = [asyncio.create_task(roster.keep_plan_alive())]
        resume = self._resume
        try:
            if resume is None:
                flow.enter(Phase.GATHERING)
                # the swarm exists: come in
                await roster.publish(self.planning.publishable([(0, s.model.n_layers, [])]))
                plan = await self._first_plan(await roster.gather())
                flow.enter(Phase.PLANNING)
                self.store.begin_epoch(0)  # checkpoints left in this folder by another run are not ours
                await roster.publish(plan)
                self.progress.message("plan: " + self.planning.describe())
                for peer_id, (a, b, _) in self.planning.planned.items():
                    record.artifacts.log("assign", peer=peer_id, layers=[a, b])
            else:
                flow.enter(Phase.PLANNING)
                await self._announce_resume()
            background.append(asyncio.create_task(roster.watch()))
            if resume is None:
                await flow.wait(flow.joined, s.join_timeout, "the planned peers to dial in")
            else:
                await flow.wait(flow.joined, min(s.join_timeout, RESUME_TIMEOUT), "the peers to re-attach")
            await self._train(adopted=resume is not None and resume.started)
        except KeyboardInterrupt:
            self.progress.message("interrupted: finishing the current step, then stopping the swarm")
            code = 130
            if flow.started and not flow.failed.is_set():
                await self._stop_after_step()
        except RunFailed as e:
            flow.fatal = str(e)
            if flow.started and not roster.uncovered:  # give the DHT time to tell who is gone
                await asyncio.sleep(0)
                deadline = time.monotonic() + self.membership.ttl + 3 * self.membership.s.heartbeat + 5.0
                while not roster.uncovered and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            self.progress.message(f"run failed: {roster.departures[0] if roster.departures else e}")
            code = 1
        finally:
            self.progress.stop()
            for task in background:
                task.cancel()
        if code == 0 or (code == 130 and flow.finished.is_set()):
            flow.enter(Phase.COLLECTING)
            await self._collect_and_save()
        flow.enter(Phase.DONE)
        record.save_state(finished=code == 0)
        await self._release()
        record.write_summary(list(self.sessions.peers.values()))
        record.write_plot()
        return code

    async def _first_plan(self, records: list) -> Plan:
        """The first plan; one that does not fit the peers' memory waits for more (serve) or ends the run."""
        while True:
            try:
                plan = self.planning.plan_for(records)
                self.flow.waiting = ""
                return plan
            except NoPlanFits as e:
                if not self.s.wait_for_fit:
                    raise
                if self.flow.waiting != str(e):
                    self.progress.message(f"waiting for more peers or memory: {e}")
                self.flow.waiting = str(e)
                records = await self.roster.gather_more(records, str(e), self.planning.holds_a_layer)

    async def _train(self, *, adopted: bool) -> None:
        """Start training (or follow a swarm that trained on while we were away) until the last step,
        recovering from every failure that a checkpoint can undo."""
        s, flow, sessions = self.s, self.flow, self.sessions
        first_step = 0
        if not self.record.train_t0:
            self.record.train_t0 = time.monotonic()
        adopted = adopted and all(x.adopted for x in sessions.peers.values())
        resumed_started = self._resume is not None and self._resume.started
        last_failure: tuple[str, int] | None = None
        while True:
            flow.enter(Phase.TRAINING)
            try:
                if adopted:  # the swarm trained on while the coordinator was away: follow it
                    adopted = False
                    flow.started = True
                    self.progress.start()
                    self.progress.message(f"re-attached all {len(sessions.peers)} peers: training goes on")
                    self.record.artifacts.log(
                        "resume", step=self.record.last_step + 1, plan_version=self.planning.plan_version
                    )
                    await flow.wait(flow.finished, float("inf"), "training to finish")
                    return
                if resumed_started and not flow.started:
                    flow.started = True  # a peer came back without its block: restart all from a checkpoint
                    raise RunFailed("not every peer re-attached with its block")
                await flow.wait(flow.ready, s.ready_timeout, "every peer to load its block")
                first = sessions.first()
                if first is None:  # its session ended after it was ready
                    raise RunFailed("no peer holds stage 0 (the data source) to start training")
                start = cpb.Start(first_step=first_step, num_steps=s.train.steps - first_step)
                first.commands.put_nowait(cpb.Command(start=start))
                flow.incident_ends_at_step = bool(flow.incident)
                if not flow.started:
                    flow.started = True
                    self.record.baseline = {x.peer_id: x.stats for x in sessions.peers.values()}
                    self.progress.start()
                await flow.wait(flow.finished, float("inf"), "training to finish")
                return
            except RunFailed as e:
                if not (flow.started and s.train.checkpoint_every):
                    raise
                failure = (str(e), self.record.last_step)
                if failure == last_failure:  # the same, with no step done since: a restart will not mend it
                    raise RunFailed(f"{e} (again after a recovery, with no step done in between)") from None
                last_failure = failure
                first_step = await self.recovery.recover(str(e))

    async def _announce_resume(self) -> None:
        """Re-publish the saved plan (same version, same endpoints) so that the redialling peers find us."""
        plan = self.planning.plan
        if plan is None:
            raise RunFailed("the saved state has no plan; start the run over with --fresh")
        await self.roster.publish(plan)
        self.progress.message(
            f"resuming run {self.run_id!r} from its saved state: plan v{self.planning.plan_version} "
            f"{self.planning.describe()}; {self.record.last_step + 1} steps done; waiting for the peers to re-attach"
        )

    async def _stop_after_step(self, timeout: float = 30.0) -> None:
        first = self.sessions.first()
        if first is None:  # no data source left: no step is running
            return
        first.commands.put_nowait(cpb.Command(stop_training=cpb.StopTraining()))
        try:
            await asyncio.wait_for(self.flow.finished.wait(), timeout)
        except TimeoutError:
            self.progress.message(f"the swarm did not finish its step within {timeout:.0f} s")

    async def _collect_and_save(self) -> None:
        for session in self.sessions.peers.values():
            session.commands.put_nowait(cpb.Command(collect_state=cpb.CollectState()))
        try:
            await asyncio.wait_for(self.flow.states_in.wait(), self.s.state_timeout)
        except TimeoutError:
            self.progress.message("no checkpoint written: the blocks' parameters did not arrive in time")
            return
        self.record.write_model()

    async def _release(self) -> None:
        for session in self.sessions.peers.values():
            session.commands.put_nowait(cpb.Command(shutdown=cpb.Shutdown(reason="run over")))
            session.commands.put_nowait(None)
