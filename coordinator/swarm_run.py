"""One training run as the coordinator sees it: who joined, the plan, progress, and the ending.

The coordinator is the only place that decides: which block each peer holds (an equal split here;
the throughput-aware planner replaces it), when training starts and stops, and what happens when a
peer fails. Peers only report; they never talk to the coordinator about each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from coordinator.artifacts import RunArtifacts
from coordinator.control_service import ControlService
from coordinator.progress import Progress
from swarm.config import ModelConfig, TrainConfig
from swarm.messages import model_to_pb, train_to_pb
from swarm.model import even_split
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.transport import GRPC_OPTIONS

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot go on; the message says why, for the person watching."""


@dataclass
class PeerSession:
    peer_id: str
    endpoint: str
    device: str
    free_memory: int
    commands: asyncio.Queue = field(default_factory=asyncio.Queue)
    stage: int | None = None
    ready: bool = False
    stats: cpb.StageStats = field(default_factory=cpb.StageStats)
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class RunSettings:
    name: str
    run_dir: Path
    model: ModelConfig
    train: TrainConfig
    peers: int
    host: str = "127.0.0.1"
    port: int = 0
    join_timeout: float = 120.0
    ready_timeout: float = 120.0
    state_timeout: float = 120.0
    model_name: str = "custom"


class SwarmRun:
    def __init__(self, settings: RunSettings, progress: Progress | None = None) -> None:
        self.s = settings
        self.run_id = settings.name
        self.sessions: dict[str, PeerSession] = {}
        self.artifacts = RunArtifacts(settings.run_dir)
        self.progress = progress or Progress(total_steps=settings.train.steps)
        self.train_losses: list[tuple[int, float]] = []
        self.val_losses: list[tuple[int, float]] = []
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.port = 0
        self._joined = asyncio.Event()
        self._ready = asyncio.Event()
        self._finished = asyncio.Event()
        self._states_in = asyncio.Event()
        self._failure: str | None = None
        self._failed = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._started = False
        self._last_step = -1

    # ---- called by the control service ----------------------------------------------------------
    def register(self, req: cpb.JoinRequest) -> PeerSession:
        if req.peer_id in self.sessions:
            raise ValueError(f"a peer named {req.peer_id!r} already joined; pick another --name")
        if len(self.sessions) >= self.s.peers:
            raise ValueError(f"this run already has its {self.s.peers} peers")
        session = PeerSession(req.peer_id, req.endpoint, req.device, req.free_memory)
        self.sessions[req.peer_id] = session
        log.info("peer %s joined from %s (%s)", req.peer_id, req.endpoint, req.device)
        if len(self.sessions) == self.s.peers:
            self._joined.set()
        return session

    def known(self, peer_id: str) -> bool:
        return peer_id in self.sessions

    def lost(self, peer_id: str, why: str) -> None:
        if not self._finished.is_set() or not self._states_in.is_set():
            self.fail(f"peer {peer_id} left the run: {why}")

    def fail(self, reason: str) -> None:
        if self._failure is None and not self._stop_requested.is_set():
            self._failure = reason
            log.error("run failed: %s", reason)
        self._failed.set()

    def on_report(self, r: cpb.StatusReport) -> None:
        session = self.sessions[r.peer_id]
        session.last_seen = time.monotonic()
        session.stats = r.stats
        if r.ready:
            session.ready = True
            if all(s.ready for s in self.sessions.values()) and len(self.sessions) == self.s.peers:
                self._ready.set()
        for st in r.steps:
            self.train_losses.append((st.step, st.loss))
            self._last_step = st.step
            self.artifacts.log("step", step=st.step, loss=st.loss, tokens=st.tokens, seconds=st.seconds)
            self.progress.on_step(st.step, st.loss, st.tokens, st.seconds)
        for ev in r.evals:
            self.val_losses.append((ev.step, ev.loss))
            self.artifacts.log("eval", step=ev.step, loss=ev.loss, tokens=ev.tokens)
            self.progress.on_eval(ev.step, ev.loss)
        self.progress.on_wire(sum(s.stats.bytes_sent for s in self.sessions.values()))
        if r.finished:
            self._finished.set()
        if r.error:
            self.fail(f"peer {r.peer_id}: {r.error}")

    def on_state(self, peer_id: str, stage: int, tensors: dict[str, torch.Tensor]) -> None:
        self.states[stage] = tensors
        if len(self.states) == len(self.sessions):
            self._states_in.set()

    # ---- the run --------------------------------------------------------------------------------
    async def start_server(self) -> int:
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        cgrpc.add_ControlServicer_to_server(ControlService(self), self._server)
        self.port = self._server.add_insecure_port(f"{self.s.host}:{self.s.port}")
        if self.port == 0:
            raise RunFailed(f"cannot listen on {self.s.host}:{self.s.port}; is the port in use?")
        await self._server.start()
        return self.port

    def request_stop(self) -> None:
        """Ctrl-C: finish the current step, save what we have, release everyone."""
        self._stop_requested.set()

    async def _wait(self, event: asyncio.Event, timeout: float, what: str) -> None:
        waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._failed.wait()),
                   asyncio.ensure_future(self._stop_requested.wait())}
        done, pending = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        if self._failed.is_set() and self._failure:
            raise RunFailed(self._failure)
        if event.is_set():
            return
        if self._stop_requested.is_set():
            raise KeyboardInterrupt
        raise RunFailed(f"timed out after {timeout:.0f} s waiting for {what}")

    def _plan(self) -> list[PeerSession]:
        order = list(self.sessions.values())
        bounds = even_split(self.s.model.n_layers, len(order))
        for stage, session in enumerate(order):
            session.stage = stage
        for stage, (session, (a, b)) in enumerate(zip(order, bounds, strict=True)):
            up = order[stage - 1] if stage > 0 else None
            down = order[stage + 1] if stage + 1 < len(order) else None
            assign = cpb.Assignment(
                run_id=self.run_id, stage=stage, num_stages=len(order), layer_start=a, layer_end=b,
                model=model_to_pb(self.s.model), train=train_to_pb(self.s.train),
                upstream_endpoint=up.endpoint if up else "", downstream_endpoint=down.endpoint if down else "",
                upstream_peer=up.peer_id if up else "", downstream_peer=down.peer_id if down else "",
            )
            session.commands.put_nowait(cpb.Command(assign=assign))
            self.artifacts.log("assign", peer=session.peer_id, stage=stage, layers=[a, b])
        return order

    async def run(self) -> int:
        """Drive the run to its end; returns the process exit code."""
        s = self.s
        self.artifacts.write_config(s.model, s.train, {"run_id": self.run_id, "peers": s.peers})
        code = 0
        try:
            await self._wait(self._joined, s.join_timeout, f"{s.peers} peers to join")
            order = self._plan()
            self.progress.message(
                "plan: " + ", ".join(f"{p.peer_id}=layers[{a},{b})" for p, (a, b) in
                                     zip(order, even_split(s.model.n_layers, len(order)), strict=True)))
            await self._wait(self._ready, s.ready_timeout, "every peer to load its block")
            order[0].commands.put_nowait(cpb.Command(start=cpb.Start(first_step=0, num_steps=s.train.steps)))
            self._started = True
            self.progress.start()
            await self._wait(self._finished, float("inf"), "training to finish")
        except KeyboardInterrupt:
            self.progress.message("interrupted: finishing the current step, then stopping the swarm")
            code = 130
            if self._started and not self._failed.is_set():
                await self._stop_after_step()
        except RunFailed as e:
            self.progress.message(f"run failed: {e}")
            code = 1
        finally:
            self.progress.stop()
        if code == 0 or (code == 130 and self._finished.is_set()):
            await self._collect_and_save()
        await self._release()
        self._write_plot()
        return code

    async def _stop_after_step(self, timeout: float = 30.0) -> None:
        first = next(s for s in self.sessions.values() if s.stage == 0)
        first.commands.put_nowait(cpb.Command(stop_training=cpb.StopTraining()))
        try:
            await asyncio.wait_for(self._finished.wait(), timeout)
        except TimeoutError:
            self.progress.message(f"the swarm did not finish its step within {timeout:.0f} s")

    async def _collect_and_save(self) -> None:
        for session in self.sessions.values():
            session.commands.put_nowait(cpb.Command(collect_state=cpb.CollectState()))
        try:
            await asyncio.wait_for(self._states_in.wait(), self.s.state_timeout)
        except TimeoutError:
            self.progress.message("no checkpoint written: the blocks' parameters did not arrive in time")
            return
        merged: dict[str, torch.Tensor] = {}
        for stage in sorted(self.states):
            merged.update(self.states[stage])
        path = self.artifacts.write_checkpoint(
            merged, self.s.model, {"run_id": self.run_id, "step": str(self._last_step + 1)}
        )
        self.progress.message(f"checkpoint: {path}")

    def _write_plot(self) -> None:
        plot = self.artifacts.plot_losses(self.train_losses, self.val_losses)
        if plot is not None:
            self.progress.message(f"loss curve: {plot}")
        if self.val_losses:
            self.progress.message(f"final validation loss: {self.val_losses[-1][1]:.4f}")
        self.progress.message(f"run artefacts: {self.artifacts.dir}")

    async def _release(self) -> None:
        for session in self.sessions.values():
            session.commands.put_nowait(cpb.Command(shutdown=cpb.Shutdown(reason="run over")))
            session.commands.put_nowait(None)

    async def stop_server(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=2.0)
        self.artifacts.close()
