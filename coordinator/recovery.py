"""Recovery: a peer is gone, leaves, is excluded, or a better plan waits; re-plan and restart from a checkpoint.

A lost replica needs no restart (``roster.Roster.replica_gone``). Anything else makes the run loop call
``recover``: hand blocks over at a step boundary when nobody died (a leave, a join), find out who is gone,
re-plan the survivors (and joiners), start a new checkpoint epoch at the latest complete version, and
send everyone their new Assignment.
"""

from __future__ import annotations

import asyncio
import logging
import time

from coordinator.checkpoint_store import CheckpointStore
from coordinator.membership import Membership
from coordinator.planning import Planning
from coordinator.progress import Progress
from coordinator.roster import Roster
from coordinator.run_flow import Phase, RunFlow
from coordinator.run_record import RunRecord
from coordinator.run_settings import RunFailed, RunSettings
from coordinator.sessions import PeerSession, Sessions
from swarm.dht.plan_view import plan_view
from swarm.pb import control_pb2 as cpb

log = logging.getLogger(__name__)


class Recovery:
    def __init__(
        self,
        settings: RunSettings,
        membership: Membership,
        planning: Planning,
        sessions: Sessions,
        roster: Roster,
        flow: RunFlow,
        record: RunRecord,
        store: CheckpointStore,
        progress: Progress,
    ) -> None:
        self.s = settings
        self.membership = membership
        self.planning = planning
        self.sessions = sessions
        self.roster = roster
        self.flow = flow
        self.record = record
        self.store = store
        self.progress = progress

    def peer_lost(self, peer_id: str, why: str, session: PeerSession | None = None) -> None:
        """A control stream broke: the peer process is gone (its DHT record will expire too)."""
        if session is not None and self.sessions.peers.get(peer_id) is not session:
            return  # a stream this peer already replaced by re-attaching
        if not self.flow.states_in.is_set():
            log.warning("peer %s: %s", peer_id, why)
            if self._replica_only(peer_id):
                asyncio.ensure_future(self.roster.replica_gone(peer_id, f"is gone ({why})"))
                return
            self.sessions.lost.add(peer_id)
            self.flow.note_incident(f"lost peer {peer_id} ({why})", peer_id, self.planning.block(peer_id))

    def peer_failed(self, peer_id: str, reason: str) -> None:
        """A peer process died (seen by its launcher); ignored if recovery already dealt with it."""
        if self._replica_only(peer_id):
            asyncio.ensure_future(self.roster.replica_gone(peer_id, reason))
            return
        if peer_id in self.sessions.peers or not self.flow.started:
            self.sessions.lost.add(peer_id)
            self.flow.note_incident(reason, peer_id, self.planning.block(peer_id))
            self.flow.fail(reason)

    def _replica_only(self, peer_id: str) -> bool:
        """Training, and another peer holds this one's block: the swarm goes on without a restart."""
        return self.flow.started and not self.flow.recovering and self.planning.replicated(peer_id)

    async def _await_departures(self) -> set[str]:
        """Who is gone: broken control streams at once, expired or withdrawn DHT records within 3 heartbeats."""
        deadline = time.monotonic() + self.membership.ttl + 2 * self.membership.s.heartbeat
        while time.monotonic() < deadline:
            gone = (self.sessions.lost | self.sessions.departed) & set(self.sessions.peers)
            if gone:
                return gone
            await asyncio.sleep(0.1)
        return set()

    async def _records(self) -> list:
        """The survivors' records; the DHT gets until a record's lifetime to answer (a stalled DHT process)."""
        deadline = time.monotonic() + self.membership.ttl
        while (found := await self.roster.records()) is None:
            if time.monotonic() > deadline:
                raise RunFailed("the DHT did not answer when the survivors were looked up")
            await asyncio.sleep(self.membership.s.heartbeat)
        return found

    def _drop_left_out(self) -> set[str]:
        """End the sessions of peers that the new plan gives no block, and say they are gone from it.

        A peer whose DHT record expired while the survivors were read (a stalled heartbeat on a busy
        machine) is not among them, yet its control stream may still be up; asking the plan for its
        assignment would fail. It is out of this plan: its stream ends, and it can join again."""
        left_out = set(self.sessions.peers) - set(self.planning.planned)
        for peer_id in left_out:
            log.warning("peer %s has no block in the new plan; ending its session", peer_id)
            self.roster.removed[peer_id] = time.monotonic()
            self.sessions.drop(peer_id)
        return left_out

    async def _checkpoint_now(self, timeout: float = 60.0) -> int | None:
        """Finish the current step everywhere, then checkpoint every block at that version (nothing lost)."""
        first = self.sessions.first()
        if first is None:
            return None
        first.commands.put_nowait(cpb.Command(stop_training=cpb.StopTraining()))
        try:
            await asyncio.wait_for(self.flow.finished.wait(), timeout)
        except TimeoutError:
            return None
        version = self.record.last_step + 1
        for session in self.sessions.peers.values():
            session.commands.put_nowait(cpb.Command(collect_state=cpb.CollectState(checkpoint=True)))
        deadline = time.monotonic() + timeout
        while not self.store.is_complete(version):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.1)
        return version

    async def recover(self, reason: str) -> int:
        """Re-plan the surviving peers and restart them from the latest complete checkpoint."""
        t0 = time.monotonic()
        flow, sessions, roster, planning = self.flow, self.sessions, self.roster, self.planning
        flow.enter(Phase.RECOVERING)
        flow.note_incident(reason)
        flow.handled()
        self.progress.message(f"recovering: {reason}")
        try:
            leavers = sessions.leaving & set(sessions.peers)
            joiners, roster.joiners = roster.joiners, []
            if (leavers and not (sessions.lost & leavers)) or joiners:  # hand blocks over at a step: lose nothing
                if await self._checkpoint_now() is None:
                    self.progress.message("could not checkpoint now; falling back to the last checkpoint")
                for peer_id in leavers:
                    sessions.release(peer_id)
                    sessions.lost.add(peer_id)
            # nobody gone: a join, or a link broke while every peer lives: restart them all
            gone = await self._await_departures() if not joiners or leavers else set()
            for peer_id in gone:
                roster.removed[peer_id] = time.monotonic()  # its record may outlive it by a few heartbeats
                sessions.drop(peer_id)
                planning.planned.pop(peer_id, None)
            alive = {r.peer_id: r for r in await self._records() if r.state != "leaving"}
            survivors = [alive[p] for p in sorted(sessions.peers) if p in alive]
            survivors += [alive[p] for p in joiners if p in alive and p not in sessions.peers]
            if not survivors:
                raise RunFailed(f"{reason}; no peer is left to continue")
            version = planning.restore_version = self.store.latest_complete() or 0
            self.store.begin_epoch(version)  # the dead plan's later checkpoints go; its uploads are refused
            self.record.redo_from(version)
            await roster.publish(planning.plan_for(survivors))
            gone |= self._drop_left_out()
            sessions.lost -= gone
            sessions.departed -= gone
            roster.uncovered.clear()
            roster.departures.clear()
            flow.ready.clear()
            flow.finished.clear()
            for peer_id, session in sessions.peers.items():
                session.ready = False
                assignment = planning.assignment(peer_id)
                session.stage = plan_view(planning.plan, peer_id).stage
                session.commands.put_nowait(cpb.Command(assign=assignment))
            if joiners:  # they dial in when they see the new plan, and get their assignment then
                flow.joined.clear()
                await flow.wait(flow.joined, self.s.join_timeout, "the joining peers to dial in")
            lost_steps = max(0, self.record.last_step + 1 - version)
            self.progress.message(
                f"recovered without {', '.join(sorted(gone)) or 'losing a peer'}: plan "
                + planning.describe()
                + f"; resuming from step {version} ({lost_steps} steps redone) in {time.monotonic() - t0:.1f} s"
            )
            self.record.artifacts.log(
                "recovery",
                gone=sorted(gone),
                from_step=version,
                lost_steps=lost_steps,
                seconds=time.monotonic() - t0,
                reason=reason,
            )
            return version
        finally:
            flow.handled()
            flow.enter(Phase.TRAINING)
