"""The peers' sessions: who is attached on a control stream, who re-attached with its block, who is gone.

A peer joins on ``Control.Join`` and keeps that stream open: the coordinator's commands go down it
(``PeerSession.commands``; ``None`` ends the stream). A peer that re-attaches after a coordinator restart
or a broken stream carries a ``ResumeClaim``; when the claim matches what the current plan gives it, the
session is *adopted* (it trains on with its block, no new assignment), otherwise it is re-assigned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from coordinator.checkpoint_store import CheckpointStore
from coordinator.membership import Membership
from coordinator.planning import Planning
from coordinator.progress import Progress
from coordinator.run_flow import RunFlow
from swarm.dht.plan_view import plan_view, stage_of
from swarm.pb import control_pb2 as cpb
from swarm.resume import ResumeClaim

log = logging.getLogger(__name__)


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


class Sessions:
    def __init__(
        self, planning: Planning, flow: RunFlow, membership: Membership, progress: Progress, store: CheckpointStore
    ) -> None:
        self.planning = planning
        self.flow = flow
        self.membership = membership
        self.progress = progress
        self.store = store
        self.peers: dict[str, PeerSession] = {}
        self.lost: set[str] = set()  # control stream broken (or told to go): gone for the next re-plan
        self.departed: set[str] = set()  # DHT record expired or withdrawn
        self.leaving: set[str] = set()  # asked to leave
        self.released: set[str] = set()  # leave granted: gone, whatever the DHT still says
        self.excluded: dict[str, str] = {}  # peer id -> why: never planned again in this run
        self.records_due: dict[str, float] = {}  # re-attached peers: when their DHT record must be back

    def register(self, req: cpb.JoinRequest, claim: ResumeClaim | None = None) -> PeerSession:
        """A peer dialled in (Control.Join): PermissionError or ValueError say why it may not."""
        planned = self.planning.planned
        if req.peer_id in self.excluded:
            raise PermissionError(f"peer {req.peer_id!r} is excluded from this run: {self.excluded[req.peer_id]}")
        if req.peer_id in self.peers and claim is not None:
            # the same peer (its name is proven by the swarm token) re-attaching after its control stream
            # broke: the new stream replaces the old one, which may not have noticed yet
            old = self.peers.pop(req.peer_id)
            old.commands.put_nowait(None)
            self.lost.discard(req.peer_id)
            log.info("peer %s re-attached on a new control stream", req.peer_id)
        if req.peer_id in self.peers:
            raise ValueError(f"a peer named {req.peer_id!r} already joined; pick another --name")
        if req.peer_id not in planned:
            raise PermissionError(f"peer {req.peer_id!r} is not in the current plan of swarm {self.planning.s.swarm!r}")
        if req.endpoint != planned[req.peer_id][2]:
            raise PermissionError(
                f"peer {req.peer_id!r} joined from {req.endpoint}, but its DHT record "
                f"announced {planned[req.peer_id][2]}"
            )
        session = PeerSession(req.peer_id, req.endpoint, req.device, req.free_memory)
        self.peers[req.peer_id] = session
        assignment = self.planning.assignment(req.peer_id)
        session.stage = plan_view(self.planning.plan, req.peer_id).stage
        if claim is not None and self._matches(claim, req.peer_id):
            session.adopted = session.ready = True  # it trains on with the block it has: no new assignment
            self.records_due[req.peer_id] = time.monotonic() + self.membership.ttl + 2 * self.membership.s.heartbeat
            self.progress.message(
                f"peer {req.peer_id} re-attached with stage {claim.stage} layers [{claim.layer_start},"
                f"{claim.layer_end}) at weight version {claim.weight_version} (generation {claim.generation})"
            )
            self.check_ready()
        else:
            if claim is not None:
                self.progress.message(f"peer {req.peer_id} re-attached, but not with its planned block: re-assigning")
            session.commands.put_nowait(cpb.Command(assign=assignment))
        log.info("peer %s joined from %s (%s)", req.peer_id, req.endpoint, req.device)
        if set(self.peers) == set(planned):
            self.flow.joined.set()
        return session

    def _matches(self, claim: ResumeClaim, peer_id: str) -> bool:
        """Does a re-attaching peer hold exactly what the current plan gives it?"""
        plan = self.planning.plan
        if plan is None or stage_of(plan, peer_id) is None:
            return False
        view = plan_view(plan, peer_id)
        return (
            claim.run_id == self.planning.run_id
            and claim.plan_version <= plan.version  # a newer plan that kept its block
            and (claim.stage, (claim.layer_start, claim.layer_end)) == (view.stage, view.layers)
            and claim.weight_version >= self.planning.restore_version
            and claim.epoch == self.store.epoch  # its block belongs to the current timeline
        )

    def known(self, peer_id: str) -> bool:
        return peer_id in self.peers

    def held_block(self, peer_id: str) -> tuple[int, int, int] | None:
        """(stage, layer_start, layer_end) that ``peer_id`` holds in the current plan; None: no block."""
        planned, session = self.planning.planned.get(peer_id), self.peers.get(peer_id)
        if planned is None or session is None:
            return None
        return session.stage, planned[0], planned[1]

    def check_ready(self) -> None:
        """Every planned peer attached and loaded its block: training may start."""
        if all(x.ready for x in self.peers.values()) and set(self.peers) >= set(self.planning.planned):
            self.flow.ready.set()

    def state_of(self, session: PeerSession) -> str:
        """What `ravn status` and the metrics call this peer now."""
        if session.peer_id not in self.planning.planned:
            return "lost"
        return "training" if self.flow.started and session.ready else "ready" if session.ready else "joining"

    def first(self) -> PeerSession | None:
        """The session of stage 0 (the data source), which starts and stops training."""
        return next((x for x in self.peers.values() if x.stage == 0), None)

    def drop(self, peer_id: str) -> PeerSession | None:
        """Forget a peer's session and end its control stream."""
        session = self.peers.pop(peer_id, None)
        if session is not None:
            session.commands.put_nowait(None)
        return session

    def release(self, peer_id: str) -> None:
        """Grant a leave: the peer goes now. Its DHT tombstone comes only after it closed its Stage, and
        on a busy machine its last record may expire first, so the grant itself says it left."""
        self.released.add(peer_id)
        self.peers[peer_id].commands.put_nowait(cpb.Command(shutdown=cpb.Shutdown(reason="leave granted")))

    def send_all(self, command: cpb.Command) -> None:
        for session in self.peers.values():
            session.commands.put_nowait(command)
