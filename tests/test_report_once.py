"""A step is logged once, whatever the network does to the report that carries it.

A peer keeps a report with steps until a Report call succeeds. Under load the call can time out at the
peer after the coordinator has already logged it; the peer then sends the same steps again. Before,
``metrics.jsonl`` got those steps (and validations) twice, with no recovery between them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from coordinator.run_settings import RunSettings
from coordinator.sessions import PeerSession
from coordinator.swarm_run import SwarmRun
from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.pb import control_pb2 as cpb


def make_run(tmp_path: Path) -> SwarmRun:
    settings = RunSettings(
        name="once", run_dir=tmp_path, model=MODEL_PRESETS["gpt-tiny"], train=TrainConfig(steps=100), peers=1
    )
    run = SwarmRun(settings, SimpleNamespace(s=SimpleNamespace(heartbeat=1.0)))
    run.sessions.peers["p0"] = PeerSession("p0", "/ip4/127.0.0.1/tcp/1", "cpu", 0, stage=0)
    return run


def report(steps: range, evals: tuple[int, ...] = ()) -> cpb.StatusReport:
    r = cpb.StatusReport(peer_id="p0")
    for s in steps:
        r.steps.add(step=s, loss=5.0 - s / 10, tokens=64, seconds=0.1)
    for s in evals:
        r.evals.add(step=s, loss=4.0, tokens=64)
    return r


def test_a_re_sent_report_logs_its_steps_once(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    run.reports.on_report(report(range(0, 4), evals=(3,)))
    run.reports.on_report(report(range(0, 6), evals=(3, 5)))  # the first call timed out at the peer: sent again, merged
    assert [s for s, _ in run.record.train_losses] == list(range(6))
    assert [s for s, _ in run.record.val_losses] == [3, 5]


def test_steps_redone_after_a_recovery_are_logged_again(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    run.reports.on_report(report(range(0, 8)))
    run.record.redo_from(5)  # a recovery restored checkpoint v5: steps 5.. run again, on the new timeline
    run.reports.on_report(report(range(5, 7)))
    assert [s for s, _ in run.record.train_losses] == [*range(8), 5, 6]
