"""An expired record of a peer whose control stream is open gets one record lifetime to come back.

A stall of the whole machine expires every record at once though nobody died (the real-process case is
tests/test_machine_stall.py); a peer without an open stream, or one whose record stays away, still goes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.test_leave_granted import Records, make_run, membership_events, record, watch_until_failed


async def watch_for(run, seconds: float) -> str:
    task = asyncio.create_task(run.roster.watch())
    try:
        await asyncio.wait_for(run.flow.failed.wait(), seconds)
    except TimeoutError:
        pass
    finally:
        task.cancel()
    return run.flow.failure or ""


def test_a_record_back_within_its_lifetime_is_no_departure(tmp_path: Path) -> None:
    membership = Records([record("p0")])  # p1's record expired in a stall; its stream is open
    run = make_run(tmp_path, membership)

    async def stall_then_back() -> str:
        watching = asyncio.create_task(watch_for(run, 0.6))
        await asyncio.sleep(2 * membership.s.heartbeat)  # one or two reads without p1's record
        membership.records.append(record("p1"))  # p1 announces itself again
        return await watching

    assert asyncio.run(stall_then_back()) == ""
    assert "p1" in run.planning.planned
    assert not (tmp_path / "metrics.jsonl").exists() or membership_events(tmp_path) == []


def test_a_record_that_stays_away_is_a_departure_even_with_an_open_stream(tmp_path: Path) -> None:
    membership = Records([record("p0")])
    run = make_run(tmp_path, membership)
    failure = asyncio.run(watch_until_failed(run))
    assert "peer p1 stopped heartbeating" in failure, failure


def test_a_peer_without_an_open_stream_goes_at_the_first_expiry(tmp_path: Path) -> None:
    membership = Records([record("p0")])
    membership.s.heartbeat = 1.0  # one read within the test: a grace would outlast it
    run = make_run(tmp_path, membership)
    run.sessions.lost.add("p1")  # its control stream broke
    assert "peer p1 stopped heartbeating" in asyncio.run(watch_until_failed(run, timeout=1.8))


def test_a_peer_planned_again_gets_a_fresh_grace(tmp_path: Path) -> None:
    """A grace that began before the peer left the plan (a recovery dropped it) is not carried into its
    next time in the plan."""
    membership = Records([record("p0")])
    membership.s.heartbeat = 0.2  # grace 0.6 s
    run = make_run(tmp_path, membership)
    planned_p1 = run.planning.planned["p1"]

    async def scenario() -> str:
        task = asyncio.create_task(run.roster.watch())
        try:
            await asyncio.sleep(0.3)  # one read without p1's record: its grace began
            del run.planning.planned["p1"]  # a recovery re-planned without it
            await asyncio.sleep(1.0)  # long after that grace would have ended
            run.planning.planned["p1"] = planned_p1  # planned again; its record is still late
            await asyncio.sleep(0.3)  # one read: within a fresh grace
            return run.flow.failure or ""
        finally:
            task.cancel()

    assert asyncio.run(scenario()) == ""
