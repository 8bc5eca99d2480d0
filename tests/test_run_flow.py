"""The run's state machine (coordinator/run_flow.py): phases are logged, a failure met while recovering is
the one being handled, and waits end on the event, a failure, Ctrl-C or their deadline."""

from __future__ import annotations

import asyncio
import logging

import pytest

from coordinator.run_flow import Phase, RunFlow
from coordinator.run_settings import RunFailed


def test_phases_are_logged_and_recovery_swallows_failures(caplog: pytest.LogCaptureFixture) -> None:
    flow = RunFlow()
    with caplog.at_level(logging.INFO, logger="coordinator.run_flow"):
        for phase in (Phase.PLANNING, Phase.TRAINING, Phase.RECOVERING):
            flow.enter(phase)
        flow.fail("a peer is gone")  # what the recovery in progress handles
        assert not flow.failed.is_set() and flow.failure is None
        flow.enter(Phase.TRAINING)
        flow.fail("another peer is gone")
    assert flow.failed.is_set() and flow.failure == "another peer is gone"
    moves = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run phase")]
    assert moves == [
        "run phase: gathering -> planning",
        "run phase: planning -> training",
        "run phase: training -> recovering",
        "run phase: recovering -> training",
    ]


def test_the_first_incident_that_names_a_block_wins() -> None:
    flow = RunFlow()
    flow.note_incident("link p0 -> p1 broke")
    flow.note_incident("lost peer p1", "p1", (2, 4))  # a lost peer replaces a cause that names no block
    flow.note_incident("lost peer p2", "p2", (4, 6))
    assert (flow.incident, flow.incident_layers) == ("lost peer p1", (2, 4))
    flow.incident_ends_at_step = True
    flow.trained_again()
    assert (flow.incident, flow.incident_layers) == ("", None)


def test_waits_end_on_failure_stop_or_deadline() -> None:
    async def scenario() -> list[str]:
        ends = []
        flow = RunFlow()
        with pytest.raises(RunFailed, match="timed out after 0 s waiting for nothing"):
            await flow.wait(asyncio.Event(), 0.05, "nothing")
        ends.append("deadline")
        asyncio.get_running_loop().call_later(0.05, flow.fail, "broken")
        with pytest.raises(RunFailed, match="broken"):
            await flow.wait(asyncio.Event(), 10, "nothing")
        ends.append("failure")
        flow = RunFlow()
        asyncio.get_running_loop().call_later(0.05, flow.request_stop)
        with pytest.raises(KeyboardInterrupt):
            await flow.tick(10)
        ends.append("stop")
        return ends

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == ["deadline", "failure", "stop"]
