"""Membership as the run follows it: gathering the first peers, publishing the plan, joins and departures.

The DHT is the only source of who is in the swarm (``membership.Membership`` reads it). ``Roster``
waits for the first ``--peers`` records, keeps the current plan published, and every heartbeat compares
the live records with the plan: a planned peer whose record expires or turns ``leaving`` uncovers its
block (the run fails over to recovery), a replica that goes is simply dropped (its block is still held),
and a new peer triggers a re-plan only when it predicts more than ``JOIN_MIN_GAIN`` throughput.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from coordinator.membership import Membership
from coordinator.planning import Planning
from coordinator.progress import Progress
from coordinator.run_flow import RunFlow
from coordinator.run_record import RunRecord
from coordinator.run_settings import RunFailed, RunSettings
from coordinator.sessions import Sessions
from swarm.dht.refresh import refresh_every
from swarm.dht.schema import PeerRecord, Plan
from swarm.pb import control_pb2 as cpb

log = logging.getLogger(__name__)

PLAN_STORES_IN_FLIGHT = 3  # a stalled store lasts two DHT RPC waits (6 s): three heartbeats of 2 s
JOIN_MIN_GAIN = 0.05  # a joining peer reshuffles the swarm only for more than this predicted throughput gain


class Roster:
    def __init__(
        self,
        settings: RunSettings,
        membership: Membership,
        planning: Planning,
        sessions: Sessions,
        flow: RunFlow,
        record: RunRecord,
        progress: Progress,
        *,
        resumed: bool = False,
    ) -> None:
        self.s = settings
        self.membership = membership
        self.planning = planning
        self.sessions = sessions
        self.flow = flow
        self.record = record
        self.progress = progress
        self.resumed = resumed  # a restarted coordinator: re-attached peers' records come back late
        self.uncovered: list[str] = []  # blocks nobody holds since a planned peer went
        self.departures: list[str] = []  # why, for each of them
        self.removed: dict[str, float] = {}  # peer id -> when it was dropped (its record may outlive it)
        self.joiners: list[str] = []  # new peers the next re-plan takes in
        self.considered: set[str] = set()  # new peers already weighed (joined or standing by)
        self.missing_since: dict[str, float] = {}  # planned peers with an open stream whose record expired

    async def publish(self, plan: Plan) -> None:
        """Make ``plan`` the current one: saved on disk, stored in the DHT."""
        self.planning.plan = plan
        self.record.save_state()
        await self._store(plan)

    async def _store(self, plan: Plan) -> None:
        try:
            stored = await self.membership.publish(plan)
        except TimeoutError:  # the plan is saved on disk and re-published every heartbeat
            stored = False
        if not stored:
            log.warning("plan version %d was not stored in the DHT; retrying at the next heartbeat", plan.version)

    async def _store_current(self) -> None:
        """The heartbeat's store. It reads the plan when it runs, not when the tick made it, and never sets
        it: a re-plan between the two would otherwise be undone by the dead plan."""
        if self.planning.plan is not None:
            await self._store(self.planning.plan)

    async def records(self, *, include_leaving: bool = False) -> list[PeerRecord] | None:
        """The peers' records, or None when the DHT did not answer in time: a missed heartbeat, not the end
        of a watch (a stalled DHT process or a loaded machine; the loops here run for the whole run)."""
        try:
            return await self.membership.peers(include_leaving=include_leaving)
        except TimeoutError as e:
            log.warning("%s; asking again at the next heartbeat", e)
            return None

    async def keep_plan_alive(self) -> None:
        """Re-publish the current plan every heartbeat (DHT values expire), each store on its own clock."""
        await refresh_every(
            self.membership.s.heartbeat,
            lambda: None if self.planning.plan is None else self._store_current(),
            PLAN_STORES_IN_FLIGHT,
        )

    async def gather(self) -> list[PeerRecord]:
        """Wait until enough peers announce themselves in the DHT; the first ``peers`` by id form the plan."""
        deadline = time.monotonic() + self.s.join_timeout
        seen = -1
        while True:
            found = await self.records()
            live = [r for r in found or [] if r.state != "leaving"]
            if found is not None and len(live) != seen:
                seen = len(live)
                self.progress.message(f"{seen}/{self.s.peers} peers in swarm {self.s.swarm!r}")
            if len(live) >= self.s.peers:
                return sorted(live, key=lambda r: r.peer_id)[: self.s.peers]
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"only {len(live)} of {self.s.peers} peers joined swarm {self.s.swarm!r} "
                    f"within {self.s.join_timeout:.0f} s"
                )
            await self.flow.tick(self.membership.s.heartbeat)

    async def gather_more(
        self, tried: list[PeerRecord], why: str, usable: Callable[[PeerRecord], bool]
    ) -> list[PeerRecord]:
        """After a first plan did not fit: wait until a peer joins or one announces other memory, then take
        every live peer that is ``usable`` (can hold a layer), at least ``--peers`` of them; RunFailed with
        ``why`` at the join deadline."""
        deadline = time.monotonic() + self.s.join_timeout
        before = {(r.peer_id, r.free_memory_bytes) for r in tried}
        while True:
            await self.flow.tick(self.membership.s.heartbeat)
            found = await self.records()
            if found is None:
                continue
            live = [r for r in found if r.state != "leaving"]
            fit = [r for r in live if usable(r)]
            if len(fit) >= self.s.peers and {(r.peer_id, r.free_memory_bytes) for r in live} != before:
                self.progress.message(f"{len(fit)} peers in swarm {self.s.swarm!r} can hold a layer: planning again")
                return sorted(fit, key=lambda r: r.peer_id)
            if time.monotonic() > deadline:
                raise RunFailed(f"{why} (waited {self.s.join_timeout:.0f} s for more peers)")

    def consider_joins(self, records: dict[str, PeerRecord]) -> None:
        """A new peer during training: re-plan if it predicts enough throughput gain (hysteresis)."""
        now = time.monotonic()
        recently_gone = {p for p, t in self.removed.items() if now - t < 2 * self.membership.ttl}
        planned, sessions = self.planning.planned, self.sessions
        fresh = [
            r
            for pid, r in records.items()
            if pid not in planned
            and pid not in sessions.peers
            and pid not in self.considered
            and pid not in recently_gone  # a dead peer's record outlives it by a few heartbeats
            and pid not in sessions.lost
            and pid not in sessions.excluded
            and r.state != "leaving"
        ]
        if not fresh or not self.flow.started or self.flow.recovering or not self.s.train.checkpoint_every:
            return
        current = [records[p] for p in planned if p in records]
        try:
            before = self.planning.layout(current)[2]
            after = self.planning.layout(current + fresh)[2]
        except RunFailed:
            return
        names = ", ".join(r.peer_id for r in fresh)
        self.considered.update(r.peer_id for r in fresh)
        gain = after / before - 1 if before > 0 else 1.0
        if gain > JOIN_MIN_GAIN:
            self.joiners = [r.peer_id for r in fresh]
            self.record.artifacts.log("join", peers=self.joiners, predicted_gain=gain)
            self.flow.fail(f"{names} joined: predicted throughput {gain:+.0%}; re-planning")
        else:
            self.progress.message(
                f"{names} joined; keeping the plan (predicted gain {gain:+.0%} <= {JOIN_MIN_GAIN:.0%}): standby"
            )

    async def watch(self) -> None:
        """Planned peers whose records expire or who leave: their blocks become uncovered; new ones may join."""
        while True:
            await asyncio.sleep(self.membership.s.heartbeat)
            found = await self.records(include_leaving=True)
            if found is None:
                continue
            records = {r.peer_id: r for r in found}
            self.consider_joins(records)
            for peer_id in self.missing_since.keys() - self.planning.planned.keys():
                del self.missing_since[peer_id]  # out of the plan: a grace never carries into its next time in it
            for peer_id, (a, b, _) in list(self.planning.planned.items()):
                record = records.get(peer_id)
                left = peer_id in self.sessions.released or (record is not None and record.state == "leaving")
                if record is not None and not left:
                    self.missing_since.pop(peer_id, None)
                    continue
                if not left and self.resumed and self._awaiting_record(peer_id):
                    continue
                if not left and self._stream_vouches(peer_id):
                    continue
                self.missing_since.pop(peer_id, None)
                why = "left gracefully" if left else "stopped heartbeating (its record expired)"
                if self.flow.started and not self.flow.recovering and self.planning.replicated(peer_id):
                    await self.replica_gone(peer_id, why)
                    continue
                self.flow.note_incident(f"peer {peer_id} {why}", peer_id, (a, b))
                del self.planning.planned[peer_id]
                self.sessions.departed.add(peer_id)
                reason = f"layers [{a},{b}) are uncovered: peer {peer_id} {why}"
                if not self.s.train.checkpoint_every:
                    reason += " (no checkpoints to recover from: --checkpoint-every 0)"
                # the block and its reason together, before any await: the run loop reads the reason once
                # it sees the block uncovered
                self.uncovered.append(f"layers [{a},{b})")
                self.departures.append(reason)
                self.record.metrics.set_uncovered_blocks(len(self.uncovered))
                self.record.artifacts.log(
                    "membership", peer=peer_id, event="left" if left else "expired", layers=[a, b]
                )
                self.progress.message(f"membership: peer {peer_id} {why}; layers [{a},{b}) are now uncovered")
                if self.planning.plan is not None:
                    await self.publish(self.planning.publishable(self.planning.without(peer_id)))
                if not self.flow.finished.is_set():
                    self.flow.fail(reason)

    def _stream_vouches(self, peer_id: str) -> bool:
        """An expired record of a peer whose control stream is open gets one record lifetime to come back.

        A stall of the whole machine (a loaded PC; seen on a 2-core one for 12-18 s) expires every record
        at once though nobody died, and the coordinator, stalled too, reads the DHT before any peer could
        announce itself again. A peer that died breaks its stream (``sessions.lost``) and goes at once; one
        whose stream stays open but whose record stays away goes one record lifetime later.
        """
        if peer_id not in self.sessions.peers or peer_id in self.sessions.lost:
            return False
        now = time.monotonic()
        return now - self.missing_since.setdefault(peer_id, now) < self.membership.ttl

    def _awaiting_record(self, peer_id: str) -> bool:
        """After a restart, a peer's DHT record reaches our new DHT node only after the peer re-attached."""
        return peer_id not in self.sessions.peers or time.monotonic() < self.sessions.records_due.get(peer_id, 0.0)

    async def replica_gone(self, peer_id: str, why: str) -> None:
        """A replica vanished: its block is still held, so the swarm trains on; the others just forget it."""
        if not self.planning.replicated(peer_id):
            return
        a, b, _ = self.planning.planned.pop(peer_id)
        self.removed[peer_id] = time.monotonic()
        self.sessions.drop(peer_id)
        self.record.artifacts.log("membership", peer=peer_id, event="replica_lost", layers=[a, b], reason=why)
        self.progress.message(f"replica {peer_id} of layers [{a},{b}) {why}; its replicas carry on without it")
        if self.planning.plan is not None:
            await self.publish(self.planning.publishable(self.planning.without(peer_id)))
            for other, s in self.sessions.peers.items():
                s.commands.put_nowait(cpb.Command(update=self.planning.assignment(other)))
        if self.sessions.peers and all(x.ready for x in self.sessions.peers.values()):
            self.flow.ready.set()
