"""The run loop names it when no peer holds stage 0 at the start, instead of crashing the coordinator.

The first stage's session can end between "every peer is ready" and the start command (its peer died, its
control stream was cancelled). The loop looked the session up with a bare ``next()``, whose StopIteration
inside a coroutine turns into ``RuntimeError: coroutine raised StopIteration``: the coordinator died with
no word of why (seen once, when a plan refresh race had left no session at stage 0; fixed apart).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.run_settings import RunFailed
from coordinator.sessions import PeerSession
from tests.test_report_once import make_run


def test_a_start_with_no_first_stage_fails_the_run_with_a_reason(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    run.sessions.peers = {"p1": PeerSession("p1", "/ip4/127.0.0.1/tcp/2", "cpu", 0, stage=1)}

    async def start() -> None:
        run.flow.ready.set()
        await run._train(adopted=False)

    with pytest.raises(RunFailed, match="no peer holds stage 0"):
        asyncio.run(start())


def test_a_stop_with_no_first_stage_does_not_crash(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    run.sessions.peers = {"p1": PeerSession("p1", "/ip4/127.0.0.1/tcp/2", "cpu", 0, stage=1)}
    asyncio.run(run._stop_after_step(timeout=0.1))  # nothing to stop: nothing to wait for
