"""A DHT round that times out is one missed heartbeat, not the end of the coordinator's watch.

``list_peers`` and ``publish_plan`` raise TimeoutError when the DHT does not answer within their timeout
(a stalled DHT process, a machine under load). The roster's watch and its plan keep-alive run as
background tasks for the whole run: an exception there ended them silently, after which no departure was
ever noticed and the plan expired from the DHT.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.test_leave_granted import Records, make_run, record, watch_until_failed


class FlakyRecords(Records):
    """The first ``fails`` DHT rounds time out, as a stalled DHT's do."""

    def __init__(self, records, fails: int = 1) -> None:
        super().__init__(records)
        self.fails = fails
        self.published = 0

    async def peers(self, include_leaving: bool = False):
        if self.fails:
            self.fails -= 1
            raise TimeoutError("DHT lookup of 'ravn/x/peers' took over 10s")
        return await super().peers(include_leaving)

    async def publish(self, plan) -> bool:
        if self.fails:
            self.fails -= 1
            raise TimeoutError("DHT store under 'ravn/x/plan' took over 10s")
        self.published += 1
        return True


def test_the_watch_outlives_a_lookup_that_timed_out(tmp_path: Path) -> None:
    membership = FlakyRecords([record("p0")])  # p1's record is gone; the first lookup times out
    run = make_run(tmp_path, membership)
    run.sessions.lost.add("p1")
    failure = asyncio.run(watch_until_failed(run))
    assert "peer p1 stopped heartbeating" in failure, failure


def test_the_plan_keep_alive_outlives_a_store_that_timed_out(tmp_path: Path) -> None:
    membership = FlakyRecords([record("p0"), record("p1")])
    run = make_run(tmp_path, membership)
    run.planning.control_endpoint = "/ip4/127.0.0.1/tcp/1"
    run.planning.plan = run.planning.publishable([(0, 1, [("p0", "/ip4/127.0.0.1/tcp/1000")])])

    async def keep_alive() -> int:
        task = asyncio.create_task(run.roster.keep_plan_alive())
        try:
            for _ in range(250):
                if membership.published >= 2 or task.done():
                    break
                await asyncio.sleep(0.02)
            assert not task.done(), task.exception()
        finally:
            task.cancel()
        return membership.published

    assert asyncio.run(keep_alive()) >= 2


class SlowRecords(Records):
    """Every plan store lasts 2.5 heartbeats, as one does while a replica holds its connection and answers
    nothing (tests/test_heartbeat_stall.py, the peers' side, on a real DHT)."""

    def __init__(self, records) -> None:
        super().__init__(records)
        self.s.heartbeat = 0.1
        self.started: list[float] = []

    async def publish(self, plan) -> bool:
        self.started.append(asyncio.get_running_loop().time())
        await asyncio.sleep(2.5 * self.s.heartbeat)
        return True


def test_a_slow_plan_store_does_not_delay_the_next(tmp_path: Path) -> None:
    """The plan lives three heartbeats: stores one heartbeat apart keep it alive however long each takes."""
    membership = SlowRecords([record("p0"), record("p1")])
    run = make_run(tmp_path, membership)
    run.planning.control_endpoint = "/ip4/127.0.0.1/tcp/1"
    run.planning.plan = run.planning.publishable([(0, 1, [("p0", "/ip4/127.0.0.1/tcp/1000")])])

    async def keep_alive() -> list[float]:
        task = asyncio.create_task(run.roster.keep_plan_alive())
        try:
            await asyncio.sleep(10.5 * membership.s.heartbeat)
            assert not task.done(), task.exception()
        finally:
            task.cancel()
        return membership.started

    started = asyncio.run(keep_alive())
    gaps = [b - a for a, b in zip(started, started[1:], strict=False)]
    assert len(started) >= 8 and max(gaps) < 1.5 * membership.s.heartbeat, gaps
