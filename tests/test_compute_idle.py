"""A compute thread's idle time never runs backwards while a job is running.

On a slow block (a 0.5 B checkpoint's bf16 layers on a CPU without bf16 kernels, a minute per micro-batch)
the peer's log printed "compute busy -0%" for every 10 s window of a running job and "compute busy 900%"
when it ended: the running job counted as idle until it finished. ``ravn_peer_idle_seconds_total`` is a
Prometheus counter, and a counter that goes down reads as a restart.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import peer.compute
from peer.compute import ComputeWorker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(peer.compute.time, "monotonic", c.monotonic)
    return c


def test_a_running_job_counts_as_busy_and_idle_never_decreases(clock: Clock) -> None:
    entered, release = threading.Event(), threading.Event()

    def job() -> str:
        entered.set()
        assert release.wait(10), "the test never released the job"
        return "done"

    async def main() -> list[float]:
        worker = ComputeWorker()
        try:
            clock.now += 5.0  # idle before the job
            task = asyncio.ensure_future(worker.run(job))
            assert await asyncio.to_thread(entered.wait, 10)
            seen = [worker.idle_seconds]
            clock.now += 60.0  # a long job
            seen.append(worker.idle_seconds)
            release.set()
            assert await task == "done"
            seen.append(worker.idle_seconds)
            return seen
        finally:
            release.set()
            await asyncio.to_thread(worker.close)

    idle = asyncio.run(main())
    assert idle == [5.0, 5.0, 5.0], idle
