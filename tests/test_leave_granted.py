"""A peer whose leave the coordinator granted has left gracefully, whether or not its tombstone arrived.

The peer writes a ``leaving`` tombstone into the DHT as it goes, but only after it closed its Stage; on a
loaded machine its last heartbeat record can expire first (CI saw this: "stopped heartbeating" for a
peer that had asked to leave and been released). The coordinator knows better than the DHT here: it
granted the leave itself. The real-process check is tests/test_discovery.py's graceful-leave test.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

from coordinator.run_settings import RunSettings
from coordinator.sessions import PeerSession
from coordinator.swarm_run import SwarmRun
from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.pb import control_pb2 as cpb


class Records:
    """The DHT as the coordinator's membership sees it: the records listed, nothing more."""

    def __init__(self, records: list[SimpleNamespace]) -> None:
        self.records = records
        self.s = SimpleNamespace(heartbeat=0.02)

    @property
    def ttl(self) -> float:
        return 3 * self.s.heartbeat

    async def peers(self, include_leaving: bool = False) -> list[SimpleNamespace]:
        return [r for r in self.records if include_leaving or r.state != "leaving"]


def record(peer_id: str, state: str = "training") -> SimpleNamespace:
    return SimpleNamespace(peer_id=peer_id, state=state)


def make_run(tmp_path: Path, membership: Records) -> SwarmRun:
    settings = RunSettings(
        name="leave",
        run_dir=tmp_path,
        model=MODEL_PRESETS["gpt-tiny"],
        train=TrainConfig(checkpoint_every=0),  # no handover: the leave is granted at once
        peers=2,
    )
    run = SwarmRun(settings, membership)
    for i, name in enumerate(["p0", "p1"]):
        run.planning.planned[name] = (i, i + 1, f"/ip4/127.0.0.1/tcp/{1000 + i}")
        run.sessions.peers[name] = PeerSession(name, run.planning.planned[name][2], "cpu", 0, stage=i)
    run.flow.started = True
    return run


async def watch_until_failed(run: SwarmRun, timeout: float = 5.0) -> str:
    task = asyncio.create_task(run.roster.watch())
    try:
        await asyncio.wait_for(run.flow.failed.wait(), timeout)
    finally:
        task.cancel()
    return run.flow.failure or ""


def membership_events(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [x for x in map(json.loads, lines) if x["kind"] == "membership"]


def test_a_released_peer_whose_record_expired_before_its_tombstone_left_gracefully(tmp_path: Path) -> None:
    membership = Records([record("p0"), record("p1")])
    run = make_run(tmp_path, membership)
    run.reports.on_report(cpb.StatusReport(peer_id="p1", leaving=True))
    assert run.sessions.peers["p1"].commands.get_nowait().shutdown.reason == "leave granted"
    membership.records = [record("p0")]  # its heartbeat record expired; the tombstone never came
    failure = asyncio.run(watch_until_failed(run))
    assert "peer p1 left gracefully" in failure, failure
    assert [(e["peer"], e["event"]) for e in membership_events(run.s.run_dir)] == [("p1", "left")]


def test_a_released_peer_is_gone_at_once_even_while_its_old_record_lingers(tmp_path: Path) -> None:
    """Released, it trains no more: waiting for its record to expire or turn into a tombstone only delays
    what the coordinator already knows."""
    membership = Records([record("p0"), record("p1")])
    run = make_run(tmp_path, membership)
    run.reports.on_report(cpb.StatusReport(peer_id="p1", leaving=True))
    failure = asyncio.run(watch_until_failed(run))
    assert "peer p1 left gracefully" in failure, failure


def test_a_peer_that_expired_without_asking_to_leave_stopped_heartbeating(tmp_path: Path) -> None:
    membership = Records([record("p0")])
    run = make_run(tmp_path, membership)
    failure = asyncio.run(watch_until_failed(run))
    assert "peer p1 stopped heartbeating" in failure, failure
    assert [(e["peer"], e["event"]) for e in membership_events(run.s.run_dir)] == [("p1", "expired")]
