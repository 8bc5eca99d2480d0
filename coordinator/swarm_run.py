"""One training run as the coordinator sees it: who joined, the plan, progress, and the ending.

The coordinator is the only place that decides: which block each peer holds (an equal split here;
the throughput-aware planner replaces it), when training starts and stops, and what happens when a
peer fails. Peers only report; they never talk to the coordinator about each other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import torch

from coordinator.artifacts import RunArtifacts
from coordinator.call_checks import checkpoint_window
from coordinator.checkpoint_store import CheckpointStore
from coordinator.control_service import ControlService
from coordinator.membership import Membership, make_plan
from coordinator.placement import PlacementError, Unarrangeable, place
from coordinator.plan_inputs import model_spec, peer_specs
from coordinator.progress import Progress
from coordinator.run_state import CoordinatorState, read_events, save_state
from coordinator.status_data import (
    ExcludedPeer,
    RunStatus,
    SwarmStatus,
    blocks_from_peers,
    eta_seconds,
    peer_status_from_stats,
)
from swarm import auth, limits, tls
from swarm.config import HFConfig, ModelConfig, TrainConfig
from swarm.dht_records import seal_plan
from swarm.dht_schema import PeerRecord, Plan
from swarm.identity import plan_keys
from swarm.measure import planned_layer
from swarm.messages import hf_to_pb, model_to_pb, train_to_pb
from swarm.metrics import MetricsServer
from swarm.multiaddrs import grpc_target_to_multiaddr
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.plan_view import plan_view
from swarm.resume import ResumeClaim
from swarm.transport import GRPC_OPTIONS

log = logging.getLogger(__name__)


STATUS_WINDOW_S = 10.0
JOIN_MIN_GAIN = 0.05  # a joining peer reshuffles the swarm only for more than this predicted throughput gain
RESUME_TIMEOUT = 120.0  # a restarted coordinator waits this long for its peers to re-attach (they redial for 60 s)


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
    window: deque = field(default_factory=deque)  # (time, StageStats) of the last ~10 s, for rates
    adopted: bool = False  # re-attached to a restarted coordinator with its block, still training


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
    swarm: str = "ravn"
    announce: str = ""
    hf: HFConfig | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    swarm_token: str = ""  # every call must prove it (empty: no authentication, tests only)
    stages: int = 0  # pipeline stages (0: one per peer); spare peers become replicas
    replicate: int = -1  # the stage that gets the replicas (-1: the slowest predicted)
    tls: tls.TlsIdentity | None = None  # Control speaks TLS with this certificate, pinned by the signed plan


def settings_record(s: RunSettings) -> dict:
    """The settings a restart must repeat, as plain JSON (compared with the saved ones)."""
    record = {
        "model": asdict(s.model),
        "train": asdict(s.train),
        "hf": asdict(s.hf) if s.hf else None,
        "peers": s.peers,
        "model_name": s.model_name,
        "swarm": s.swarm,
    }
    return json.loads(json.dumps(record, default=str))


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
        self.plan: Plan | None = None
        self.plan_version = 0
        self.planned: dict[str, tuple[int, int, str]] = {}  # peer id -> (layer_start, layer_end, endpoint)
        self.uncovered: list[str] = []
        self.predicted_throughput = 0.0
        self.reachable: dict[str, bool] = {}
        self.fingerprints: dict[str, str] = {}  # peer id -> TLS fingerprint from its record ("" in clear)
        self.public_keys: dict[str, str] = {}  # peer id -> the key its record is signed with: signs its calls
        self._departures: list[str] = []
        self._lost: set[str] = set()
        self._departed: set[str] = set()
        self._recovering = False
        self._leaving: set[str] = set()
        self._joiners: list[str] = []
        self._considered: set[str] = set()
        self._removed: dict[str, float] = {}
        self.excluded: dict[str, str] = {}  # peer id -> why: never planned again in this run
        self._restore_version = 0
        self.metrics_server = MetricsServer()
        self.metrics = self.metrics_server.coordinator(settings.swarm, settings.name)
        self.metrics.set_total_steps(settings.train.steps)
        self.store = CheckpointStore(settings.run_dir / "checkpoints", settings.model.n_layers)
        self._step_tokens: list[int] = []
        self._train_t0 = 0.0
        self._baseline: dict[str, cpb.StageStats] = {}
        self.run_id = settings.name
        self.sessions: dict[str, PeerSession] = {}
        self.artifacts = RunArtifacts(settings.run_dir)
        self.progress = progress or Progress(total_steps=settings.train.steps)
        self.train_losses: list[tuple[int, float]] = []
        self.val_losses: list[tuple[int, float]] = []
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.replica_states: dict[int, dict[str, dict[str, torch.Tensor]]] = {}  # stage -> peer -> final state
        self._uploaded: set[str] = set()
        self.port = 0
        self.control_endpoint = ""
        self._joined = asyncio.Event()
        self._ready = asyncio.Event()
        self._finished = asyncio.Event()
        self._states_in = asyncio.Event()
        self._failure: str | None = None
        self._fatal = ""  # the reason the run ended in failure (no recovery left)
        self._incident = ""  # what the swarm is recovering from: `ravn status` says degraded until it trains again
        self._incident_layers: tuple[int, int] | None = None
        self._incident_ends_at_step = False  # set once training restarted: the next step report clears it
        self._failed = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._started = False
        self._last_step = -1
        self._resume = resume
        self._resumed_through = -1  # steps up to here were logged before a restart: a peer's re-send is dropped
        self._logged_through = self._evaled_through = -1  # this timeline's newest logged step and validation
        self._dht_port: int | None = None
        self._records_due: dict[str, float] = {}  # re-attached peers: when their DHT record must be back
        if resume is not None:
            self._load(resume)

    # ---- state on disk (a restarted coordinator picks the run up) -------------------------------
    def _state(self, *, finished: bool = False) -> CoordinatorState:
        if self._dht_port is None:  # asks the DHT process: once, not at every report
            found = [re.search(r"/tcp/(\d+)", m) for m in self.membership.maddrs()]
            self._dht_port = next((int(m[1]) for m in found if m), 0)
        return CoordinatorState(
            run_id=self.run_id,
            swarm=self.s.swarm,
            settings=settings_record(self.s),
            port=self.port,
            dht_port=self._dht_port,
            plan=self.plan.model_dump(mode="json") if self.plan is not None else None,
            planned=self.planned,
            reachable=self.reachable,
            started=self._started,
            finished=finished,
            last_step=self._last_step,
            restore_version=self._restore_version,
            train_seconds=time.monotonic() - self._train_t0 if self._train_t0 else 0.0,
            checkpoints=self.store.describe(),
            saved_at=time.time(),
        )

    def _save_state(self, *, finished: bool = False) -> None:
        """Write the run's state atomically; runs on the event loop after every plan and step report."""
        if not self.port:
            return
        try:
            save_state(self.s.run_dir, self._state(finished=finished))
        except OSError as e:
            log.warning("could not save the coordinator state: %s", e)

    def _load(self, state: CoordinatorState) -> None:
        """Take over a saved run: its plan, step count and losses (from metrics.jsonl), its restore point."""
        self.plan = Plan.model_validate(state.plan) if state.plan is not None else None
        self.plan_version = self.plan.version if self.plan is not None else 0
        self.planned = {p: (a, b, e) for p, (a, b, e) in state.planned.items()}
        self.reachable = dict(state.reachable)
        if self.plan is not None:  # pins survive a restart: later plans (a replica lost) must keep them
            self.fingerprints = {p.peer_id: p.tls_fingerprint for st in self.plan.stages for p in st.peers}
            self.public_keys = plan_keys(self.plan)
        self._restore_version = state.restore_version
        self._last_step = state.last_step
        for event in read_events(self.s.run_dir):
            if event.get("kind") == "step":
                self.train_losses.append((event["step"], event["loss"]))
                self._step_tokens.append(event["tokens"])
                self._last_step = event["step"]
            elif event.get("kind") == "eval":
                self.val_losses.append((event["step"], event["loss"]))
        self._resumed_through = self._last_step
        self.progress.step = self._last_step
        if state.started:
            self._train_t0 = time.monotonic() - state.train_seconds
        if state.started and self._last_step + 1 >= self.s.train.steps:
            self._finished.set()  # killed while collecting the blocks: the final report will not come again

    # ---- called by the control service ----------------------------------------------------------
    def register(self, req: cpb.JoinRequest, claim: ResumeClaim | None = None) -> PeerSession:
        if req.peer_id in self.excluded:
            raise PermissionError(f"peer {req.peer_id!r} is excluded from this run: {self.excluded[req.peer_id]}")
        if req.peer_id in self.sessions and claim is not None:
            # the same peer (its name is proven by the swarm token) re-attaching after its control stream
            # broke: the new stream replaces the old one, which may not have noticed yet
            old = self.sessions.pop(req.peer_id)
            old.commands.put_nowait(None)
            self._lost.discard(req.peer_id)
            log.info("peer %s re-attached on a new control stream", req.peer_id)
        if req.peer_id in self.sessions:
            raise ValueError(f"a peer named {req.peer_id!r} already joined; pick another --name")
        if req.peer_id not in self.planned:
            raise PermissionError(f"peer {req.peer_id!r} is not in the current plan of swarm {self.s.swarm!r}")
        if req.endpoint != self.planned[req.peer_id][2]:
            raise PermissionError(
                f"peer {req.peer_id!r} joined from {req.endpoint}, but its DHT record "
                f"announced {self.planned[req.peer_id][2]}"
            )
        session = PeerSession(req.peer_id, req.endpoint, req.device, req.free_memory)
        self.sessions[req.peer_id] = session
        assignment = self._assignment(req.peer_id)
        session.stage = assignment.stage
        if claim is not None and self._matches(claim, assignment):
            session.adopted = session.ready = True  # it trains on with the block it has: no new assignment
            self._records_due[req.peer_id] = time.monotonic() + self.membership.ttl + 2 * self.membership.s.heartbeat
            self.progress.message(
                f"peer {req.peer_id} re-attached with stage {claim.stage} layers [{claim.layer_start},"
                f"{claim.layer_end}) at weight version {claim.weight_version} (generation {claim.generation})"
            )
            if all(x.ready for x in self.sessions.values()) and set(self.sessions) >= set(self.planned):
                self._ready.set()
        else:
            if claim is not None:
                self.progress.message(f"peer {req.peer_id} re-attached, but not with its planned block: re-assigning")
            session.commands.put_nowait(cpb.Command(assign=assignment))
        log.info("peer %s joined from %s (%s)", req.peer_id, req.endpoint, req.device)
        if set(self.sessions) == set(self.planned):
            self._joined.set()
        return session

    def _matches(self, claim: ResumeClaim, a: cpb.Assignment) -> bool:
        """Does a re-attaching peer hold exactly what the current plan gives it?"""
        return (
            self.plan is not None
            and claim.run_id == self.run_id
            and claim.plan_version <= self.plan.version  # one peer per stage: same blocks, same neighbours
            and (claim.stage, claim.layer_start, claim.layer_end) == (a.stage, a.layer_start, a.layer_end)
            and claim.weight_version >= self._restore_version
            and claim.epoch == self.store.epoch  # its block belongs to the current timeline
        )

    def known(self, peer_id: str) -> bool:
        return peer_id in self.sessions

    def checkpoint_window(self) -> tuple[int, int]:
        """The versions a periodic checkpoint may carry now (see coordinator/call_checks.py)."""
        t = self.s.train
        return checkpoint_window(self._restore_version, self._last_step, t.steps, t.checkpoint_every, t.staleness_bound)

    def peer_key(self, peer_id: str) -> str | None:
        """The key of ``peer_id``'s signed record, pinned when it was planned: only its holder may call as it."""
        return self.public_keys.get(peer_id)

    def lost(self, peer_id: str, why: str, session: PeerSession | None = None) -> None:
        """A control stream broke: the peer process is gone (its DHT record will expire too)."""
        if session is not None and self.sessions.get(peer_id) is not session:
            return  # a stream this peer already replaced by re-attaching
        if not self._states_in.is_set():
            log.warning("peer %s: %s", peer_id, why)
            if self._started and not self._recovering and self._replicated(peer_id):
                asyncio.ensure_future(self._replica_gone(peer_id, f"is gone ({why})"))
                return
            self._lost.add(peer_id)
            self._note_incident(f"lost peer {peer_id} ({why})", peer_id)

    def _note_incident(self, why: str, peer_id: str | None = None) -> None:
        """Remember what went wrong until the swarm trains again (what `ravn status` names).

        The first cause wins, except that a lost peer replaces a cause that names no block: its neighbours'
        broken links are often reported a moment before the coordinator sees the peer's stream end.
        """
        if self._finished.is_set() or (self._incident and (self._incident_layers or not peer_id)):
            return
        self._incident = why
        planned = self.planned.get(peer_id) if peer_id else None
        self._incident_layers = planned[:2] if planned else None
        self._incident_ends_at_step = False

    def peer_failed(self, peer_id: str, reason: str) -> None:
        """A peer process died (seen by its launcher); ignored if recovery already dealt with it."""
        if self._started and not self._recovering and self._replicated(peer_id):
            asyncio.ensure_future(self._replica_gone(peer_id, reason))
            return
        if peer_id in self.sessions or not self._started:
            self._lost.add(peer_id)
            self._note_incident(reason, peer_id)
            self.fail(reason)

    def fail(self, reason: str) -> None:
        if self._recovering:
            log.info("during recovery: %s", reason)
            return
        if self._failure is None and not self._stop_requested.is_set():
            self._failure = reason
            log.warning("problem: %s", reason)
        self._failed.set()

    def redo_from(self, version: int) -> None:
        """A recovery restored checkpoint ``version``: its steps and validations are redone and count again."""
        self._resumed_through = -1
        self._logged_through = self._evaled_through = version - 1

    def on_report(self, r: cpb.StatusReport) -> None:
        session = self.sessions[r.peer_id]
        session.last_seen = now = time.monotonic()
        session.stats = r.stats
        session.window.append((now, r.stats))
        while len(session.window) > 2 and now - session.window[0][0] > STATUS_WINDOW_S:
            session.window.popleft()
        if r.ready:
            session.ready = True
            if all(x.ready for x in self.sessions.values()) and set(self.sessions) >= set(self.planned):
                self._ready.set()
        if r.steps and self._incident_ends_at_step:
            self._incident, self._incident_layers, self._incident_ends_at_step = "", None, False
        # a report is re-sent whenever its call failed at the peer, also after the coordinator had it
        steps = [st for st in r.steps if st.step > max(self._resumed_through, self._logged_through)]
        evals = [ev for ev in r.evals if ev.step > max(self._resumed_through, self._evaled_through)]
        if len(steps) < len(r.steps):
            log.info("dropped %d step reports already logged (a re-sent report)", len(r.steps) - len(steps))
        if steps:
            self._logged_through = max(st.step for st in steps)
        if evals:
            self._evaled_through = max(ev.step for ev in evals)
        for st in steps:
            self.train_losses.append((st.step, st.loss))
            self._last_step = st.step
            self.artifacts.log("step", step=st.step, loss=st.loss, tokens=st.tokens, seconds=st.seconds)
            self.progress.on_step(st.step, st.loss, st.tokens, st.seconds)
            self._step_tokens.append(st.tokens)
            self.metrics.on_step(st.step, st.loss, st.tokens)
        for ev in evals:
            self.val_losses.append((ev.step, ev.loss))
            self.artifacts.log("eval", step=ev.step, loss=ev.loss, tokens=ev.tokens)
            self.progress.on_eval(ev.step, ev.loss)
            self.metrics.on_eval(ev.step, ev.loss)
        wire = sum(x.stats.bytes_sent for x in self.sessions.values())
        self.progress.on_wire(wire)
        self.metrics.set_wire_bytes(wire)
        self.metrics.set_peers(Counter(self._peer_state(x) for x in self.sessions.values()))
        if r.finished:
            self._finished.set()
        for q in r.quarantined:
            self._exclude(q.peer_id, q.reason, by=r.peer_id)
        if steps or r.finished:
            self._save_state()
        if r.error:
            self.fail(f"peer {r.peer_id}: {r.error}")
        if r.leaving and r.peer_id not in self._leaving:
            self._leaving.add(r.peer_id)
            self.progress.message(f"peer {r.peer_id} asks to leave: checkpointing the swarm to hand its block over")
            if self._started and self.s.train.checkpoint_every and not self._finished.is_set():
                self.fail(f"peer {r.peer_id} is leaving")
            else:
                session.commands.put_nowait(cpb.Command(shutdown=cpb.Shutdown(reason="leave granted")))

    def _exclude(self, peer_id: str, reason: str, *, by: str) -> None:
        """A neighbour reports ``peer_id`` as poisoned: drop it from the plan and re-plan without it.

        The accuser is trusted (every member holds the token; see SECURITY.md) and named in the reason.
        The excluded peer is told why and released; recovery then treats it as departed, and neither
        re-planning nor a later join brings it back in this run."""
        if peer_id in self.excluded or peer_id not in self.sessions or peer_id == by:
            return
        why = f"{_printable(reason)} (reported by {by})"
        self.excluded[peer_id] = why
        self.progress.message(f"excluding peer {peer_id}: {why}")
        self.artifacts.log("exclude", peer=peer_id, by=by, reason=why)
        if self._finished.is_set():  # the run is over: it still uploads its block, then leaves with the rest
            return
        self.sessions[peer_id].commands.put_nowait(cpb.Command(shutdown=cpb.Shutdown(reason=f"excluded: {why}")))
        self._lost.add(peer_id)
        self.fail(f"peer {peer_id} excluded: {why}")

    def _peer_state(self, session: PeerSession) -> str:
        if session.peer_id not in self.planned:
            return "lost"
        return "training" if self._started and session.ready else "ready" if session.ready else "joining"

    def status(self) -> SwarmStatus:
        """The swarm as `ravn status` shows it: run progress, each peer, each block."""
        tokens_per_mb = self.s.train.micro_batch_size * self.s.model.context
        peers = []
        for x in self.sessions.values():
            a, b = self.planned.get(x.peer_id, (0, 0, ""))[:2]
            if b == 0 and self.plan is not None and x.stage is not None and x.stage < len(self.plan.stages):
                a, b = self.plan.stages[x.stage].layer_start, self.plan.stages[x.stage].layer_end  # a lost peer
            if b == 0:
                continue  # no block to show (its row would not parse)
            (t0, then), (t1, now) = (x.window[0], x.window[-1]) if x.window else ((0.0, None), (0.0, x.stats))
            peers.append(
                peer_status_from_stats(
                    name=x.peer_id,
                    device=x.device,
                    block=(a, b),
                    state=self._peer_state(x),
                    now=now,
                    then=then if t1 > t0 else None,
                    window_s=t1 - t0,
                    heartbeat_age_s=time.monotonic() - x.last_seen,
                    tokens_per_micro_batch=tokens_per_mb,
                )
            )
        blocks: tuple = ()
        if self.plan is not None and any(st.peers for st in self.plan.stages):
            ranges = [(st.layer_start, st.layer_end) for st in self.plan.stages]
            replicas = {r: sum(1 for a, b, _ in self.planned.values() if (a, b) == r) for r in ranges}
            blocks = blocks_from_peers(peers, ranges, replicas=replicas)
        steps = len(self._step_tokens)
        elapsed = time.monotonic() - self._train_t0 if self._train_t0 else 0.0
        tokens = sum(self._step_tokens)
        run = RunStatus(
            name=self.run_id,
            step=steps,
            total_steps=self.s.train.steps,
            loss=self.train_losses[-1][1] if self.train_losses else None,
            val_loss=self.val_losses[-1][1] if self.val_losses else None,
            tokens_per_s=self.progress.tokens_per_s or None,
            eta_s=eta_seconds(steps, self.s.train.steps, elapsed),
            wire_bytes_per_token=(sum(x.stats.bytes_sent for x in self.sessions.values()) / tokens) if tokens else None,
            loss_history=tuple(v for _, v in self.train_losses[-120:]),
            heartbeat_s=self.membership.s.heartbeat,
            max_staleness=self.s.train.staleness_bound,
            **self._trouble(),
        )
        excluded = tuple(ExcludedPeer(name=p, reason=why) for p, why in self.excluded.items())
        return SwarmStatus(
            run=run, peers=tuple(peers), blocks=blocks, swarm=self.s.swarm, generated_at=time.time(), excluded=excluded
        )

    def _trouble(self) -> dict[str, object]:
        """``failure`` (broken) only when no recovery can follow; otherwise what is being recovered (degraded)."""
        recoverable = self._started and bool(self.s.train.checkpoint_every) and not self._fatal
        failure = self._fatal or ("" if recoverable else self._failure or "")
        recovering = self._incident or ((self._failure or "") if recoverable else "")
        return {
            "failure": failure,
            "recovering": recovering,
            "recovering_layers": self._incident_layers if recovering else None,
        }

    def on_state(self, peer_id: str, stage: int, tensors: dict[str, torch.Tensor]) -> None:
        self.states[stage] = tensors
        self.replica_states.setdefault(stage, {})[peer_id] = tensors
        self._uploaded.add(peer_id)
        if self._uploaded >= set(self.sessions):
            self._states_in.set()

    def replica_disagreement(self) -> float | None:
        """Largest absolute difference between replicas of one block in the final upload (None: no replicas)."""
        worst = None
        for by_peer in self.replica_states.values():
            states = list(by_peer.values())
            for other in states[1:]:
                for name, t in states[0].items():
                    diff = float((t.float() - other[name].float()).abs().max()) if t.numel() else 0.0
                    worst = diff if worst is None else max(worst, diff)
        return worst

    # ---- the run --------------------------------------------------------------------------------
    async def start_server(self) -> int:
        interceptors = []
        if self.s.swarm_token:
            verifier = auth.Verifier(self.s.swarm_token, audiences=[auth.COORDINATOR_AUDIENCE], keys=self.peer_key)
            interceptors = [auth.ServerAuth(verifier), limits.ServerLimits(limits.LimitSettings(inflight_per_sender=8))]
        self._server = grpc.aio.server(options=GRPC_OPTIONS + limits.SERVER_OPTIONS, interceptors=interceptors)
        cgrpc.add_ControlServicer_to_server(ControlService(self), self._server)
        self.port = tls.add_port(self._server, f"{self.s.host}:{self.s.port}", self.s.tls)
        if self.port == 0:
            raise RunFailed(f"cannot listen on {self.s.host}:{self.s.port}; is the port in use?")
        await self._server.start()
        if self.s.metrics_port is not None:
            port = self.metrics_server.start(self.s.metrics_port, self.s.metrics_host)
            self.progress.message(f"Prometheus metrics on http://{self.s.metrics_host}:{port}/metrics")
        self.control_endpoint = grpc_target_to_multiaddr(f"{self.s.announce or self.s.host}:{self.port}")
        return self.port

    @property
    def tls_fingerprint(self) -> str:
        """The certificate the Control service presents ("" in clear): every plan carries it, the first too."""
        return self.s.tls.fingerprint if self.s.tls is not None else ""

    def request_stop(self) -> None:
        """Ctrl-C: finish the current step, save what we have, release everyone."""
        self._stop_requested.set()

    async def _wait(self, event: asyncio.Event, timeout: float, what: str) -> None:
        waiters = {
            asyncio.ensure_future(event.wait()),
            asyncio.ensure_future(self._failed.wait()),
            asyncio.ensure_future(self._stop_requested.wait()),
        }
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

    # ---- membership and the plan ----------------------------------------------------------------
    def _plan_for(self, records: list[PeerRecord]) -> Plan:
        """The placement of ``coordinator/placement.py`` (chain, replicas, NAT rule) as a signed plan."""
        self.reachable = {r.peer_id: r.reachable is not False for r in records}
        blocks, groups, throughput = self._layout(records)
        endpoints = {r.peer_id: r.endpoint for r in records}
        self.fingerprints = {r.peer_id: r.tls_fingerprint for r in records}
        self.public_keys = {r.peer_id: r.public_key for r in records if r.public_key}
        stages = [(a, b, [(p, endpoints[p]) for p in group]) for (a, b), group in zip(blocks, groups, strict=True)]
        self.planned = {p: (a, b, endpoints[p]) for a, b, peers in stages for p, _ in peers}
        self.predicted_throughput = throughput
        replicated = [
            f"stage {i} layers [{a},{b}) x{len(g)}"
            for i, ((a, b), g) in enumerate(zip(blocks, groups, strict=True))
            if len(g) > 1
        ]
        if replicated:
            self.progress.message("replicas: " + ", ".join(replicated))
        behind_nat = [g[0] for g in groups if not self.reachable[g[0]]]
        if behind_nat:
            self.progress.message(f"behind NAT (they dial their neighbours): {', '.join(behind_nat)}")
        return self._publishable(stages)

    def _layout(self, records: list[PeerRecord]) -> tuple[list[tuple[int, int]], list[list[str]], float]:
        """Blocks, their holders in pipeline order and the predicted micro-batches/s (no side effects)."""
        spec = model_spec(self.s.model, self.s.train, self.s.hf)
        try:
            placed = place(peer_specs(records), spec, stages=self.s.stages, replicate=self.s.replicate)
        except Unarrangeable as e:
            raise RunFailed(f"blocked on reachability: {e}") from None
        except PlacementError as e:
            raise RunFailed(f"no plan fits these peers: {e}") from None
        blocks = [(b.layer_start, b.layer_end) for b in placed.blocks]
        return blocks, [list(b.peer_ids) for b in placed.blocks], placed.throughput

    def _replicated(self, peer_id: str) -> bool:
        """Does another planned peer still hold this peer's block?"""
        block = self.planned.get(peer_id)
        return block is not None and any(p != peer_id and v[:2] == block[:2] for p, v in self.planned.items())

    async def _replica_gone(self, peer_id: str, why: str) -> None:
        """A replica vanished: its block is still held, so the swarm trains on; the others just forget it."""
        if not self._replicated(peer_id):
            return
        a, b, _ = self.planned.pop(peer_id)
        self._removed[peer_id] = time.monotonic()
        session = self.sessions.pop(peer_id, None)
        if session is not None:
            session.commands.put_nowait(None)
        self.artifacts.log("membership", peer=peer_id, event="replica_lost", layers=[a, b], reason=why)
        self.progress.message(f"replica {peer_id} of layers [{a},{b}) {why}; its replicas carry on without it")
        if self.plan is not None:
            stages = [
                (st.layer_start, st.layer_end, [(p.peer_id, p.endpoint) for p in st.peers if p.peer_id != peer_id])
                for st in self.plan.stages
            ]
            await self._publish(self._publishable(stages))
            for other, s in self.sessions.items():
                s.commands.put_nowait(cpb.Command(update=self._assignment(other)))
        if self.sessions and all(x.ready for x in self.sessions.values()):
            self._ready.set()

    def _publishable(self, stages: list[tuple[int, int, list[tuple[str, str]]]]) -> Plan:
        self.plan_version += 1
        return make_plan(
            reachable=self.reachable,
            fingerprints=self.fingerprints,
            public_keys=self.public_keys,
            coordinator_tls_fingerprint=self.tls_fingerprint,
            layer=planned_layer(self.s.model, self.s.train, self.s.hf),
            swarm=self.s.swarm,
            run_id=self.run_id,
            version=self.plan_version,
            model_name=self.s.model_name,
            coordinator=self.control_endpoint,
            stages=stages,
        )

    async def _publish(self, plan: Plan) -> None:
        self.plan = plan
        self._save_state()
        if not await self.membership.publish(plan):
            log.warning("plan version %d was not stored in the DHT; retrying at the next heartbeat", plan.version)

    async def _keep_plan_alive(self) -> None:
        while True:
            await asyncio.sleep(self.membership.s.heartbeat)
            if self.plan is not None:
                await self._publish(self.plan)

    async def _gather(self) -> list[PeerRecord]:
        """Wait until enough peers announce themselves in the DHT; the first ``peers`` by id form the plan."""
        deadline = time.monotonic() + self.s.join_timeout
        seen = -1
        while True:
            live = [r for r in await self.membership.peers() if r.state != "leaving"]
            if len(live) != seen:
                seen = len(live)
                self.progress.message(f"{seen}/{self.s.peers} peers in swarm {self.s.swarm!r}")
            if len(live) >= self.s.peers:
                return sorted(live, key=lambda r: r.peer_id)[: self.s.peers]
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"only {len(live)} of {self.s.peers} peers joined swarm {self.s.swarm!r} "
                    f"within {self.s.join_timeout:.0f} s"
                )
            await self._tick(self.membership.s.heartbeat)

    async def _tick(self, seconds: float) -> None:
        """Sleep, but wake for Ctrl-C or a failure."""
        waiters = [asyncio.ensure_future(e.wait()) for e in (self._failed, self._stop_requested)]
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        if self._failed.is_set() and self._failure:
            raise RunFailed(self._failure)
        if self._stop_requested.is_set():
            raise KeyboardInterrupt

    def _consider_joins(self, records: dict[str, PeerRecord]) -> None:
        """A new peer during training: re-plan if it predicts enough throughput gain (hysteresis)."""
        now = time.monotonic()
        recently_gone = {p for p, t in self._removed.items() if now - t < 2 * self.membership.ttl}
        fresh = [
            r
            for pid, r in records.items()
            if pid not in self.planned
            and pid not in self.sessions
            and pid not in self._considered
            and pid not in recently_gone  # a dead peer's record outlives it by a few heartbeats
            and pid not in self._lost
            and pid not in self.excluded
            and r.state != "leaving"
        ]
        if not fresh or not self._started or self._recovering or not self.s.train.checkpoint_every:
            return
        current = [records[p] for p in self.planned if p in records]
        try:
            before = self._layout(current)[2]
            after = self._layout(current + fresh)[2]
        except RunFailed:
            return
        names = ", ".join(r.peer_id for r in fresh)
        self._considered.update(r.peer_id for r in fresh)
        gain = after / before - 1 if before > 0 else 1.0
        if gain > JOIN_MIN_GAIN:
            self._joiners = [r.peer_id for r in fresh]
            self.artifacts.log("join", peers=self._joiners, predicted_gain=gain)
            self.fail(f"{names} joined: predicted throughput {gain:+.0%}; re-planning")
        else:
            self.progress.message(
                f"{names} joined; keeping the plan (predicted gain {gain:+.0%} <= {JOIN_MIN_GAIN:.0%}): standby"
            )

    async def _watch_membership(self) -> None:
        """Planned peers whose records expire or who leave: their blocks become uncovered; new ones may join."""
        while True:
            await asyncio.sleep(self.membership.s.heartbeat)
            records = {r.peer_id: r for r in await self.membership.peers(include_leaving=True)}
            self._consider_joins(records)
            for peer_id, (a, b, _) in list(self.planned.items()):
                record = records.get(peer_id)
                if record is not None and record.state != "leaving":
                    continue
                if record is None and self._resume is not None and self._awaiting_record(peer_id):
                    continue
                if record is None and self._started and not self._recovering and self._replicated(peer_id):
                    await self._replica_gone(peer_id, "stopped heartbeating (its record expired)")
                    continue
                why = "left gracefully" if record is not None else "stopped heartbeating (its record expired)"
                self._note_incident(f"peer {peer_id} {why}", peer_id)
                del self.planned[peer_id]
                self._departed.add(peer_id)
                self.uncovered.append(f"layers [{a},{b})")
                self.metrics.set_uncovered_blocks(len(self.uncovered))
                self.artifacts.log("membership", peer=peer_id, event="left" if record else "expired", layers=[a, b])
                self.progress.message(f"membership: peer {peer_id} {why}; layers [{a},{b}) are now uncovered")
                if self.plan is not None:
                    stages = [
                        (
                            st.layer_start,
                            st.layer_end,
                            [(p.peer_id, p.endpoint) for p in st.peers if p.peer_id != peer_id],
                        )
                        for st in self.plan.stages
                    ]
                    await self._publish(self._publishable(stages))
                reason = f"layers [{a},{b}) are uncovered: peer {peer_id} {why}"
                if not self.s.train.checkpoint_every:
                    reason += " (no checkpoints to recover from: --checkpoint-every 0)"
                self._departures.append(reason)
                if not self._finished.is_set():
                    self.fail(reason)

    def _awaiting_record(self, peer_id: str) -> bool:
        """After a restart, a peer's DHT record reaches our new DHT node only after the peer re-attached."""
        return peer_id not in self.sessions or time.monotonic() < self._records_due.get(peer_id, 0.0)

    def on_checkpoint(
        self, chunk: cpb.StateChunk, weights: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]
    ) -> None:
        """A stage's periodic state (runs on a worker thread): file it; note when a version completes."""
        self.store.save(chunk.epoch, chunk.version, chunk.layer_start, chunk.layer_end, weights, optim)
        if self.store.is_complete(chunk.version):
            self.store.write_index()
            self.artifacts.log("checkpoint", version=chunk.version)

    async def _await_departures(self) -> set[str]:
        """Who is gone: broken control streams at once, expired or withdrawn DHT records within 3 heartbeats."""
        deadline = time.monotonic() + self.membership.ttl + 2 * self.membership.s.heartbeat
        while time.monotonic() < deadline:
            gone = (self._lost | self._departed) & set(self.sessions)
            if gone:
                return gone
            await asyncio.sleep(0.1)
        return set()

    async def _checkpoint_now(self, timeout: float = 60.0) -> int | None:
        """Finish the current step everywhere, then checkpoint every block at that version (nothing lost)."""
        first = next((x for x in self.sessions.values() if x.stage == 0), None)
        if first is None:
            return None
        first.commands.put_nowait(cpb.Command(stop_training=cpb.StopTraining()))
        try:
            await asyncio.wait_for(self._finished.wait(), timeout)
        except TimeoutError:
            return None
        version = self._last_step + 1
        for session in self.sessions.values():
            session.commands.put_nowait(cpb.Command(collect_state=cpb.CollectState(checkpoint=True)))
        deadline = time.monotonic() + timeout
        while not self.store.is_complete(version):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.1)
        return version

    async def _recover(self, reason: str) -> int:
        """Re-plan the surviving peers and restart them from the latest complete checkpoint."""
        t0 = time.monotonic()
        self._recovering = True
        self._note_incident(reason)
        self._failure = None  # handled here; waits below must not trip over it
        self._failed.clear()
        self.progress.message(f"recovering: {reason}")
        try:
            leavers = self._leaving & set(self.sessions)
            joiners, self._joiners = self._joiners, []
            if (leavers and not (self._lost & leavers)) or joiners:  # hand blocks over at a step: lose nothing
                if await self._checkpoint_now() is None:
                    self.progress.message("could not checkpoint now; falling back to the last checkpoint")
                for peer_id in leavers:
                    self.sessions[peer_id].commands.put_nowait(
                        cpb.Command(shutdown=cpb.Shutdown(reason="leave granted"))
                    )
                    self._lost.add(peer_id)
            # nobody gone: a join, or a link broke while every peer lives: restart them all
            gone = await self._await_departures() if not joiners or leavers else set()
            for peer_id in gone:
                self._removed[peer_id] = time.monotonic()  # its record may outlive it by a few heartbeats
                session = self.sessions.pop(peer_id)
                session.commands.put_nowait(None)
                self.planned.pop(peer_id, None)
            alive = {r.peer_id: r for r in await self.membership.peers() if r.state != "leaving"}
            survivors = [alive[p] for p in sorted(self.sessions) if p in alive]
            survivors += [alive[p] for p in joiners if p in alive and p not in self.sessions]
            if not survivors:
                raise RunFailed(f"{reason}; no peer is left to continue")
            version = self._restore_version = self.store.latest_complete() or 0
            self.store.begin_epoch(version)  # the dead plan's later checkpoints go; its uploads are refused
            self.redo_from(version)
            await self._publish(self._plan_for(survivors))
            self._lost -= gone
            self._departed -= gone
            self.uncovered.clear()
            self._departures.clear()
            self._ready.clear()
            self._finished.clear()
            for peer_id, session in self.sessions.items():
                session.ready = False
                assignment = self._assignment(peer_id)
                session.stage = assignment.stage
                session.commands.put_nowait(cpb.Command(assign=assignment))
            if joiners:  # they dial in when they see the new plan, and get their assignment then
                self._joined.clear()
                await self._wait(self._joined, self.s.join_timeout, "the joining peers to dial in")
            lost_steps = max(0, self._last_step + 1 - version)
            self.progress.message(
                f"recovered without {', '.join(sorted(gone)) or 'losing a peer'}: plan "
                + ", ".join(f"{p}=layers[{a},{b})" for p, (a, b, _) in self.planned.items())
                + f"; resuming from step {version} ({lost_steps} steps redone) in {time.monotonic() - t0:.1f} s"
            )
            self.artifacts.log(
                "recovery",
                gone=sorted(gone),
                from_step=version,
                lost_steps=lost_steps,
                seconds=time.monotonic() - t0,
                reason=reason,
            )
            return version
        finally:
            self._failure = None
            self._failed.clear()
            self._recovering = False

    def _assignment(self, peer_id: str) -> cpb.Assignment:
        view = plan_view(self.plan, peer_id)
        up = next(iter(view.upstreams.items()), None)
        down = next(iter(view.downstreams.items()), None)
        sealed = seal_plan(self.plan, self.membership.key)
        return cpb.Assignment(
            run_id=self.run_id,
            stage=view.stage,
            num_stages=view.num_stages,
            layer_start=view.layers[0],
            layer_end=view.layers[1],
            model=model_to_pb(self.s.model),
            train=train_to_pb(self.s.train),
            upstream_endpoint=up[1] if up else "",
            downstream_endpoint=down[1] if down else "",
            upstream_peer=up[0] if up else "",
            downstream_peer=down[0] if down else "",
            hf=hf_to_pb(self.s.hf) if self.s.hf else None,
            restore_version=self._restore_version,
            epoch=self.store.epoch,
            dial_upstream=view.dial_upstream,
            accept_downstream=view.accept_downstream,
            upstreams=[cpb.Neighbour(peer_id=p, endpoint=e) for p, e in view.upstreams.items()],
            downstreams=[cpb.Neighbour(peer_id=p, endpoint=e) for p, e in view.downstreams.items()],
            replicas=[cpb.Neighbour(peer_id=p, endpoint=e) for p, e in view.replicas.items()]
            if view.replicated
            else [],
            plan=cpb.SignedPlan(body=sealed["body"], sig=sealed["sig"]),
        )

    async def run(self) -> int:
        """Drive the run to its end; returns the process exit code."""
        s = self.s
        self.artifacts.write_config(
            s.model,
            s.train,
            {"run_id": self.run_id, "peers": s.peers, "swarm": s.swarm, "hf": asdict(s.hf) if s.hf else None},
        )
        code = 0
        background = [asyncio.create_task(self._keep_plan_alive())]
        resume = self._resume
        try:
            if resume is None:
                await self._publish(self._publishable([(0, s.model.n_layers, [])]))  # the swarm exists: come in
                records = await self._gather()
                self.store.begin_epoch(0)  # checkpoints left in this folder by another run are not ours
                await self._publish(self._plan_for(records))
                self.progress.message(
                    "plan: " + ", ".join(f"{p}=layers[{a},{b})" for p, (a, b, _) in self.planned.items())
                )
                for peer_id, (a, b, _) in self.planned.items():
                    self.artifacts.log("assign", peer=peer_id, layers=[a, b])
            else:
                await self._announce_resume(resume)
            background.append(asyncio.create_task(self._watch_membership()))
            if resume is None:
                await self._wait(self._joined, s.join_timeout, "the planned peers to dial in")
            else:
                await self._wait(self._joined, min(s.join_timeout, RESUME_TIMEOUT), "the peers to re-attach")
            first_step = 0
            if not self._train_t0:
                self._train_t0 = time.monotonic()
            adopted = resume is not None and resume.started and all(x.adopted for x in self.sessions.values())
            while True:
                try:
                    if adopted:  # the swarm trained on while the coordinator was away: follow it
                        adopted = False
                        self._started = True
                        self.progress.start()
                        self.progress.message(f"re-attached all {len(self.sessions)} peers: training goes on")
                        self.artifacts.log("resume", step=self._last_step + 1, plan_version=self.plan_version)
                        await self._wait(self._finished, float("inf"), "training to finish")
                        break
                    if resume is not None and resume.started and not self._started:
                        self._started = True  # a peer came back without its block: restart all from a checkpoint
                        raise RunFailed("not every peer re-attached with its block")
                    await self._wait(self._ready, s.ready_timeout, "every peer to load its block")
                    first = next(x for x in self.sessions.values() if x.stage == 0)
                    start = cpb.Start(first_step=first_step, num_steps=s.train.steps - first_step)
                    first.commands.put_nowait(cpb.Command(start=start))
                    self._incident_ends_at_step = bool(self._incident)
                    if not self._started:
                        self._started = True
                        self._baseline = {x.peer_id: x.stats for x in self.sessions.values()}
                        self.progress.start()
                    await self._wait(self._finished, float("inf"), "training to finish")
                    break
                except RunFailed as e:
                    if not (self._started and s.train.checkpoint_every):
                        raise
                    first_step = await self._recover(str(e))
        except KeyboardInterrupt:
            self.progress.message("interrupted: finishing the current step, then stopping the swarm")
            code = 130
            if self._started and not self._failed.is_set():
                await self._stop_after_step()
        except RunFailed as e:
            self._fatal = str(e)
            if self._started and not self.uncovered:  # give the DHT time to tell who is gone
                await asyncio.sleep(0)
                deadline = time.monotonic() + self.membership.ttl + 3 * self.membership.s.heartbeat + 5.0
                while not self.uncovered and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            self.progress.message(f"run failed: {self._departures[0] if self._departures else e}")
            code = 1
        finally:
            self.progress.stop()
            for task in background:
                task.cancel()
        if code == 0 or (code == 130 and self._finished.is_set()):
            await self._collect_and_save()
        self._save_state(finished=code == 0)
        await self._release()
        self._write_summary()
        self._write_plot()
        return code

    async def _announce_resume(self, resume: CoordinatorState) -> None:
        """Re-publish the saved plan (same version, same endpoints) so that the redialling peers find us."""
        if self.plan is None:
            raise RunFailed("the saved state has no plan; start the run over with --fresh")
        await self._publish(self.plan)
        plan = ", ".join(f"{p}=layers[{a},{b})" for p, (a, b, _) in self.planned.items())
        self.progress.message(
            f"resuming run {self.run_id!r} from its saved state: plan v{self.plan_version} {plan}; "
            f"{self._last_step + 1} steps done; waiting for the peers to re-attach"
        )

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
        if self.s.hf is not None:
            path = self.artifacts.write_adapter(merged, self.s.hf)
            self.progress.message(f"LoRA adapter (loads with peft on {self.s.hf.path}): {path}")
            return
        path = self.artifacts.write_checkpoint(
            merged, self.s.model, {"run_id": self.run_id, "step": str(self._last_step + 1)}
        )
        self.progress.message(f"checkpoint: {path}")

    def _stage_summary(self, session: PeerSession) -> dict:
        st, base = session.stats, self._baseline.get(session.peer_id, cpb.StageStats())
        wall = st.wall_seconds - base.wall_seconds
        return {
            "peer": session.peer_id,
            "stage": session.stage,
            "weight_version": st.weight_version,
            "staleness_counts": list(st.staleness_counts),
            "dropped": st.dropped,
            "bubble_fraction": (st.idle_seconds - base.idle_seconds) / wall if wall > 0 else None,
            "compute_seconds": st.compute_seconds - base.compute_seconds,
            "bytes_sent": st.bytes_sent,
            "stash_bytes_peak": st.stash_bytes_peak,
            "in_flight_peak": st.in_flight_peak,
            "average_rounds": st.average_rounds,
            "average_bytes": st.average_bytes,
            "anchor_digest": st.anchor_digest,
            "forward_micro_batches": st.forward_micro_batches - base.forward_micro_batches,
        }

    def _write_summary(self) -> None:
        tokens = sum(self._step_tokens)
        wire = sum(x.stats.bytes_sent for x in self.sessions.values())
        seconds = time.monotonic() - self._train_t0 if self._train_t0 else 0.0
        summary = {
            "steps": len(self._step_tokens),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "wire_bytes": wire,
            "wire_bytes_per_token": wire / tokens if tokens else 0.0,
            "effective_batch_tokens": self.s.train.micro_batches * self.s.train.micro_batch_size * self.s.model.context,
            "wire_forward": self.s.train.wire_forward,
            "wire_backward": self.s.train.wire_backward,
            "error_feedback_backward": self.s.train.error_feedback_backward,
            "final_val_loss": self.val_losses[-1][1] if self.val_losses else None,
            "replica_max_abs_diff": self.replica_disagreement(),
            "average_bytes": sum(x.stats.average_bytes for x in self.sessions.values()),
            "lost_micro_batches": sum(x.stats.lost_micro_batches for x in self.sessions.values()),
        }
        summary["stages"] = [self._stage_summary(x) for x in sorted(self.sessions.values(), key=lambda x: x.stage)]
        self.artifacts.log("summary", **summary)
        if tokens:
            self.progress.message(
                f"trained {tokens:,} tokens in {seconds:.0f} s ({summary['tokens_per_s']:,.0f} tok/s); "
                f"wire {wire / 1e6:,.1f} MB, {summary['wire_bytes_per_token']:,.0f} bytes/token"
            )

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
        self.metrics_server.stop()
        if self._server is not None:
            await self._server.stop(grace=2.0)
        self.artifacts.close()


def _printable(text: str, limit: int = 300) -> str:
    """Remote text made safe for one log line and a status table: no newlines or terminal escapes."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])
