"""A step none of whose micro-batches came through has no loss (coordinator.run_record).

The driver reports such a step with 0 tokens and loss 0.0. Logged and shown as a loss, it looked like a perfect
step: a LoRA run whose first stage was quarantined finished its last ten steps at "loss 0.000" (2026-12-07)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordinator.run_settings import RunSettings
from coordinator.run_state import read_events
from coordinator.swarm_run import SwarmRun
from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.pb import control_pb2 as cpb


def test_a_step_whose_micro_batches_were_all_dropped_is_logged_without_a_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = RunSettings(
        name="drops", run_dir=tmp_path, model=MODEL_PRESETS["gpt-tiny"], train=TrainConfig(steps=10), peers=1
    )
    run = SwarmRun(settings, SimpleNamespace(s=SimpleNamespace(heartbeat=1.0)))
    report = cpb.StatusReport(
        peer_id="p0",
        steps=[
            cpb.StepResult(step=0, loss=5.5, tokens=512, seconds=1.0),
            cpb.StepResult(step=1, loss=0.0, tokens=0, seconds=1.0),  # every micro-batch dropped
        ],
    )
    with caplog.at_level(logging.WARNING):
        assert run.record.add_steps(report)
    assert run.record.train_losses == [(0, 5.5)]
    steps = [e for e in read_events(tmp_path) if e["kind"] == "step"]
    assert [(e["step"], e["loss"], e["tokens"]) for e in steps] == [(0, 5.5, 512), (1, None, 0)]
    assert "step 2: every micro-batch was dropped" in caplog.text
    assert "| loss - |" in run.record.progress._line()
    run.record.train_losses.clear()
    run.record.load(SimpleNamespace(last_step=1, started=False))  # a restarted coordinator reads the log back
    assert run.record.train_losses == [(0, 5.5)]
