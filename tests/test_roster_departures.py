"""A planned peer that goes is recorded with its reason before anything else can wait on the DHT.

CI's slow suite once ended a run with "run failed: peer p1: link to downstream p2 ... failed" instead of
"layers [3,4) are uncovered: peer p2 stopped heartbeating": the run loop waits until the roster has an
uncovered block and then reads the first departure, but the roster published the new plan (a DHT store
that takes its time) between the two, so the reason was not there yet.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from coordinator.roster import Roster


class _Planning:
    def __init__(self) -> None:
        self.planned = {"p2": (3, 4, "127.0.0.1:1")}
        self.plan = object()

    def replicated(self, peer_id: str) -> bool:
        return False

    def without(self, peer_id: str) -> object:
        return self.plan

    def publishable(self, plan: object) -> object:
        return plan


class _SlowMembership:
    """A DHT whose store does not return: what a loaded machine's store looks like to the roster."""

    s = SimpleNamespace(heartbeat=0.01)

    async def peers(self, include_leaving: bool = False) -> list:
        return []  # p2's record expired

    async def publish(self, plan: object) -> bool:
        await asyncio.Event().wait()
        return True


def test_an_uncovered_block_has_its_reason_before_the_plan_is_published() -> None:
    flow = SimpleNamespace(started=True, recovering=False, finished=asyncio.Event(), fail=lambda r: None)
    flow.note_incident = lambda *a: None
    record = SimpleNamespace(
        metrics=SimpleNamespace(set_uncovered_blocks=lambda n: None),
        artifacts=SimpleNamespace(log=lambda *a, **k: None),
        save_state=lambda: None,
    )
    roster = Roster(
        SimpleNamespace(train=SimpleNamespace(checkpoint_every=0)),
        _SlowMembership(),
        _Planning(),
        SimpleNamespace(released=set(), departed=set(), peers={}, lost=set()),
        flow,
        record,
        SimpleNamespace(message=lambda m: None),
    )
    roster.consider_joins = lambda records: None

    async def watch_until_uncovered() -> None:
        task = asyncio.ensure_future(roster.watch())
        try:
            async with asyncio.timeout(10):
                while not roster.uncovered:
                    await asyncio.sleep(0.01)
            assert roster.departures == [
                "layers [3,4) are uncovered: peer p2 stopped heartbeating (its record expired)"
                " (no checkpoints to recover from: --checkpoint-every 0)"
            ]
        finally:
            task.cancel()

    asyncio.run(watch_until_uncovered())
