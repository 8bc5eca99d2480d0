"""Where a run is (its phase) and what it waits on: the events, the failure, the incident.

The run is a state machine: ``gathering`` (peers announce themselves in the DHT) → ``planning`` (the plan
is published, its peers dial in) → ``training`` ⇄ ``recovering`` (re-plan the survivors, restart from a
checkpoint) → ``collecting`` (every block's final state comes in) → ``done``. Each change is logged. The
phase decides what a late event means: a failure seen while ``recovering`` is the one being handled.

Every other part of the coordinator signals the run loop only through this object (``fail``, the
events), so none of them needs the loop itself.
"""

from __future__ import annotations

import asyncio
import enum
import logging

from coordinator.run_settings import RunFailed

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    GATHERING = "gathering"
    PLANNING = "planning"
    TRAINING = "training"
    RECOVERING = "recovering"
    COLLECTING = "collecting"
    DONE = "done"


class RunFlow:
    def __init__(self) -> None:
        self.phase = Phase.GATHERING
        self.started = False  # training began (stays true through recoveries)
        self.joined = asyncio.Event()  # every planned peer dialled in
        self.ready = asyncio.Event()  # every planned peer loaded its block
        self.finished = asyncio.Event()  # the last step is done
        self.states_in = asyncio.Event()  # every peer's final block arrived
        self.failed = asyncio.Event()
        self.stop_requested = asyncio.Event()
        self.failure: str | None = None
        self.fatal = ""  # the reason the run ended in failure (no recovery left)
        self.incident = ""  # what the swarm is recovering from: `ravn status` says degraded until it trains again
        self.incident_layers: tuple[int, int] | None = None
        self.incident_ends_at_step = False  # set once training restarted: the next step report clears it
        self.waiting = ""  # why the first plan waits for more peers (it did not fit their memory)

    def enter(self, phase: Phase) -> None:
        """Move to ``phase`` (logged, so that a log shows where a run was when something happened)."""
        if phase is not self.phase:
            log.info("run phase: %s -> %s", self.phase.value, phase.value)
            self.phase = phase

    @property
    def recovering(self) -> bool:
        return self.phase is Phase.RECOVERING

    def fail(self, reason: str) -> None:
        """Something went wrong: the run loop wakes up and recovers (or ends); ignored during recovery."""
        if self.recovering:
            log.info("during recovery: %s", reason)
            return
        if self.failure is None and not self.stop_requested.is_set():
            self.failure = reason
            log.warning("problem: %s", reason)
        self.failed.set()

    def handled(self) -> None:
        """The failure is being dealt with: waits after this must not trip over it."""
        self.failure = None
        self.failed.clear()

    def request_stop(self) -> None:
        """Ctrl-C: finish the current step, save what we have, release everyone."""
        self.stop_requested.set()

    def note_incident(self, why: str, peer_id: str | None = None, block: tuple[int, int] | None = None) -> None:
        """Remember what went wrong until the swarm trains again (what `ravn status` names).

        The first cause wins, except that a lost peer replaces a cause that names no block: its neighbours'
        broken links are often reported a moment before the coordinator sees the peer's stream end.
        """
        if self.finished.is_set() or (self.incident and (self.incident_layers or not peer_id)):
            return
        self.incident = why
        self.incident_layers = block if peer_id else None
        self.incident_ends_at_step = False

    def trained_again(self) -> None:
        """A step was reported after a restart: the incident is over."""
        if self.incident_ends_at_step:
            self.incident, self.incident_layers, self.incident_ends_at_step = "", None, False

    def trouble(self, checkpointing: bool) -> dict[str, object]:
        """``failure`` (broken) only when no recovery can follow; otherwise what is being recovered (degraded)."""
        recoverable = self.started and checkpointing and not self.fatal
        failure = self.fatal or ("" if recoverable else self.failure or "")
        recovering = self.incident or ((self.failure or "") if recoverable else "")
        return {
            "failure": failure,
            "recovering": recovering,
            "recovering_layers": self.incident_layers if recovering else None,
        }

    async def wait(self, event: asyncio.Event, timeout: float, what: str) -> None:
        """Wait for ``event``; RunFailed on a failure or a timeout, KeyboardInterrupt on Ctrl-C."""
        waiters = {
            asyncio.ensure_future(event.wait()),
            asyncio.ensure_future(self.failed.wait()),
            asyncio.ensure_future(self.stop_requested.wait()),
        }
        done, pending = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        if self.failed.is_set() and self.failure:
            raise RunFailed(self.failure)
        if event.is_set():
            return
        if self.stop_requested.is_set():
            raise KeyboardInterrupt
        raise RunFailed(f"timed out after {timeout:.0f} s waiting for {what}")

    async def tick(self, seconds: float) -> None:
        """Sleep, but wake for Ctrl-C or a failure."""
        waiters = [asyncio.ensure_future(e.wait()) for e in (self.failed, self.stop_requested)]
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        if self.failed.is_set() and self.failure:
            raise RunFailed(self.failure)
        if self.stop_requested.is_set():
            raise KeyboardInterrupt
