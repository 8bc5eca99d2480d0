"""One compute thread per peer, with backward work ahead of forward work.

The event loop only moves bytes; every torch call runs here, one at a time, so the block's weights are
never touched by two threads. When both kinds of work are waiting, backward goes first: it frees
activation memory and unblocks the upstream stage sooner (the 1F1B rule). Idle time is measured: it is
the pipeline bubble of this stage.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

BACKWARD, FORWARD, OTHER = 0, 1, 2


class ComputeWorker:
    def __init__(self, name: str = "compute") -> None:
        self._heap: list[tuple[int, int, Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._clock = threading.Lock()  # guards the two below, so a reader sees a job either running or done
        self._busy_done = 0.0  # seconds of finished jobs
        self._job_started: float | None = None
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def idle_seconds(self) -> float:
        """Seconds without a job since the start; never decreases (it is exported as a counter)."""
        with self._clock:
            now = time.monotonic()
            since = now if self._job_started is None else self._job_started
            return max(0.0, since - self.started - self._busy_done)

    async def run(self, fn: Callable[..., Any], *args: Any, priority: int = OTHER) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._closed:
                raise RuntimeError("compute worker is closed")
            heapq.heappush(self._heap, (priority, next(self._seq), lambda: fn(*args), fut, loop))
            self._cv.notify()
        return await fut

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed and not self._heap:
                    return
                _, _, job, fut, loop = heapq.heappop(self._heap)
            with self._clock:
                self._job_started = time.monotonic()
            try:
                result, error = job(), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                result, error = None, e
            with self._clock:
                self._busy_done += time.monotonic() - self._job_started
                self._job_started = None
            loop.call_soon_threadsafe(_settle, fut, result, error)

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            for _, _, _, fut, loop in self._heap:
                loop.call_soon_threadsafe(_settle, fut, None, RuntimeError("compute worker closed"))
            self._heap.clear()
            self._cv.notify_all()
        self._thread.join(timeout)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
