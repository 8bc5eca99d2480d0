"""Storing DHT values again before they expire, on a fixed clock.

Peers' records and the coordinator's plan live three heartbeats in the DHT and are stored again every
heartbeat. hivemind's store waits for every replica: one that keeps its connections open and answers
nothing (a frozen PC, a NAT dropping packets) holds back the live replicas' copies by one DHT RPC wait and
the call by two (3 and 6 s with hivemind's defaults). Waiting for each store and then sleeping a heartbeat
spaced the stores further apart than the values live, and a live peer's record or the plan lapsed
(tests/test_heartbeat_stall.py). Here each store starts on the clock, whatever the previous ones are doing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


async def refresh_every(
    period: float, store: Callable[[], Coroutine[Any, Any, object] | None], max_in_flight: int
) -> None:
    """Start ``store()`` every ``period`` seconds until cancelled, with at most ``max_in_flight`` running.

    ``store`` returns the coroutine of one store, or None when there is nothing to store yet. A tick that
    finds ``max_in_flight`` stores still running is skipped (they hold threads, and more values than a
    value's lifetime over ``period`` are never alive at once). A store that raises is logged, never the end
    of the refreshing. Cancelling this cancels the stores in flight.
    """
    running: set[asyncio.Task] = set()

    def finished(task: asyncio.Task) -> None:
        running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a DHT refresh failed: %s", task.exception())

    next_at = time.monotonic()
    try:
        while True:
            next_at = max(next_at + period, time.monotonic())  # after a stalled loop, no burst to catch up
            await asyncio.sleep(next_at - time.monotonic())
            if len(running) >= max_in_flight:
                continue
            coro = store()
            if coro is not None:
                task = asyncio.create_task(coro)
                running.add(task)
                task.add_done_callback(finished)
    finally:
        for task in running:
            task.cancel()
