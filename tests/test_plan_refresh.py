"""The heartbeat's re-publication of the plan never brings back a plan the run has left.

CI's slow suite once failed a recovery test (1 run in 5 on a loaded machine): the survivors were sent
assignments from the dead plan, with three stages, although the recovery had just made and logged a plan
of two. The heartbeat's refresh built its store as ``publish(planning.plan)``: the coroutine took the
plan of that moment, was started a loop turn later and made it the current plan again, right after the
recovery had set the new one.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from coordinator import roster as roster_module
from coordinator.roster import Roster


class _Membership:
    s = SimpleNamespace(heartbeat=1.0)

    def __init__(self) -> None:
        self.stored: list[object] = []

    async def publish(self, plan: object) -> bool:
        await asyncio.sleep(0)  # a store leaves the event loop (it runs on a thread)
        self.stored.append(plan)
        return True


def _roster(membership: _Membership, plan: object) -> Roster:
    planning = SimpleNamespace(plan=plan)
    record = SimpleNamespace(save_state=lambda: None)
    return Roster(SimpleNamespace(), membership, planning, SimpleNamespace(), SimpleNamespace(), record, None)


def test_a_refresh_started_before_a_replan_stores_the_new_plan_and_keeps_it_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks: list = []

    async def one_tick(period: float, store, max_in_flight: int) -> None:  # noqa: ANN001 - refresh_every's
        ticks.append(store)

    monkeypatch.setattr(roster_module, "refresh_every", one_tick)
    old, new = SimpleNamespace(version=1), SimpleNamespace(version=2)
    membership = _Membership()
    roster = _roster(membership, old)

    async def race() -> None:
        await roster.keep_plan_alive()
        refresh = asyncio.ensure_future(ticks[0]())  # a heartbeat's store, made while ``old`` was current
        await roster.publish(new)  # a recovery re-plans before that store has begun
        await refresh
        assert roster.planning.plan is new, "the heartbeat's refresh made the dead plan current again"
        assert membership.stored[-1] is new, "the heartbeat's refresh stored the dead plan after the new one"

    asyncio.run(race())


def test_a_refresh_with_no_plan_yet_stores_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks: list = []

    async def one_tick(period: float, store, max_in_flight: int) -> None:  # noqa: ANN001
        ticks.append(store)

    monkeypatch.setattr(roster_module, "refresh_every", one_tick)
    membership = _Membership()
    roster = _roster(membership, None)

    async def tick() -> None:
        await roster.keep_plan_alive()
        coro = ticks[0]()
        if coro is not None:
            await coro

    asyncio.run(tick())
    assert membership.stored == []
