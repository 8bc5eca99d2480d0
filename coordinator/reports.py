"""Report intake: what a peer's once-a-second ``StatusReport`` changes, and excluding a poisoned peer.

A report carries the peer's stats (kept for rates, `ravn status` and the summary), its new steps and
validations (logged once even when re-sent), whether it is ready or finished, an error, a request to
leave, and the neighbours it quarantined; a quarantined peer is excluded from the run (``exclude``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from coordinator.progress import Progress
from coordinator.run_flow import RunFlow
from coordinator.run_record import RunRecord
from coordinator.run_settings import RunSettings
from coordinator.sessions import Sessions
from swarm.pb import control_pb2 as cpb

log = logging.getLogger(__name__)

STATUS_WINDOW_S = 10.0  # rates in `ravn status` are taken over this much report history


class ReportIntake:
    def __init__(
        self, settings: RunSettings, sessions: Sessions, flow: RunFlow, record: RunRecord, progress: Progress
    ) -> None:
        self.s = settings
        self.sessions = sessions
        self.flow = flow
        self.record = record
        self.progress = progress

    def on_report(self, r: cpb.StatusReport) -> None:
        sessions, flow = self.sessions, self.flow
        session = sessions.peers[r.peer_id]
        session.last_seen = now = time.monotonic()
        session.stats = r.stats
        session.window.append((now, r.stats))
        while len(session.window) > 2 and now - session.window[0][0] > STATUS_WINDOW_S:
            session.window.popleft()
        if r.ready:
            session.ready = True
            sessions.check_ready()
        if r.steps:
            flow.trained_again()
        stepped = self.record.add_steps(r)
        wire = sum(x.stats.bytes_sent for x in sessions.peers.values())
        self.progress.on_wire(wire)
        self.record.metrics.set_wire_bytes(wire)
        self.record.metrics.set_peers(Counter(sessions.state_of(x) for x in sessions.peers.values()))
        if r.finished:
            flow.finished.set()
        for q in r.quarantined:
            self.exclude(q.peer_id, q.reason, by=r.peer_id)
        if stepped or r.finished:
            self.record.save_state()
        if r.error and 0 < r.error_epoch < self.record.store.epoch:
            log.info(
                "peer %s: %s (a block of plan epoch %d, which the run has left: ignored)",
                r.peer_id,
                printable(r.error),
                r.error_epoch,
            )
        elif r.error:
            flow.fail(f"peer {r.peer_id}: {r.error}")
        if r.leaving and r.peer_id not in sessions.leaving:
            sessions.leaving.add(r.peer_id)
            if flow.started and self.s.train.checkpoint_every and not flow.finished.is_set():
                self.progress.message(f"peer {r.peer_id} asks to leave: checkpointing the swarm to hand its block over")
                flow.fail(f"peer {r.peer_id} is leaving")
            else:
                self.progress.message(f"peer {r.peer_id} asks to leave: released")
                sessions.release(r.peer_id)

    def exclude(self, peer_id: str, reason: str, *, by: str) -> None:
        """A neighbour reports ``peer_id`` as poisoned: drop it from the plan and re-plan without it.

        The accuser is trusted (every member holds the token; see SECURITY.md) and named in the reason.
        The excluded peer is told why and released; recovery then treats it as departed, and neither
        re-planning nor a later join brings it back in this run."""
        sessions = self.sessions
        if peer_id in sessions.excluded or peer_id not in sessions.peers or peer_id == by:
            return
        why = f"{printable(reason)} (reported by {by})"
        sessions.excluded[peer_id] = why
        self.progress.message(f"excluding peer {peer_id}: {why}")
        self.record.artifacts.log("exclude", peer=peer_id, by=by, reason=why)
        if self.flow.finished.is_set():  # the run is over: it still uploads its block, then leaves with the rest
            return
        sessions.peers[peer_id].commands.put_nowait(cpb.Command(shutdown=cpb.Shutdown(reason=f"excluded: {why}")))
        sessions.lost.add(peer_id)
        self.flow.fail(f"peer {peer_id} excluded: {why}")


def printable(text: str, limit: int = 300) -> str:
    """Remote text made safe for one log line and a status table: no newlines or terminal escapes."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])
