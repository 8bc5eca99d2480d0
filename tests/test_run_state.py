"""coordinator.run_state and swarm.resume: the coordinator's state file and a peer's resume claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.run_state import (
    CoordinatorState,
    StateError,
    forget_run,
    load_state,
    read_events,
    save_state,
    settings_diff,
    state_path,
)
from swarm.resume import RESUME_KEY, ResumeClaim


def state(**kw) -> CoordinatorState:
    base = dict(
        run_id="demo",
        swarm="ravn",
        settings={"model": {"n_layers": 3}, "train": {"steps": 100}, "peers": 3},
        port=31337,
        dht_port=31338,
        plan={"version": 2, "stages": []},
        planned={"p0": (0, 1, "/ip4/127.0.0.1/tcp/5000"), "p1": (1, 3, "/ip4/127.0.0.1/tcp/5001")},
        reachable={"p0": True, "p1": False},
        started=True,
        last_step=41,
        restore_version=40,
        train_seconds=12.5,
        checkpoints={"latest_complete": 40, "versions": [30, 40]},
    )
    return CoordinatorState(**{**base, **kw})


def test_state_round_trips(tmp_path: Path) -> None:
    assert load_state(tmp_path) is None  # nothing saved: a fresh run
    save_state(tmp_path, state())
    assert load_state(tmp_path) == state()
    save_state(tmp_path, state(last_step=42))  # replaced atomically, no temporary file left
    assert load_state(tmp_path).last_step == 42
    assert [p.name for p in tmp_path.iterdir()] == [state_path(tmp_path).name]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"run_id": "demo", "swa', "not valid JSON"),
        ("[1, 2]", "damaged"),
        (json.dumps({**json.loads(state().model_dump_json()), "port": "high"}), "port"),
        (json.dumps({**json.loads(state().model_dump_json()), "planned": {"p0": [0]}}), "planned"),
        (json.dumps({**json.loads(state().model_dump_json()), "surprise": 1}), "surprise"),
        (json.dumps({**json.loads(state().model_dump_json()), "schema_version": 99}), "schema 99"),
    ],
)
def test_a_corrupt_state_file_is_a_clear_error(tmp_path: Path, text: str, says: str) -> None:
    state_path(tmp_path).write_text(text)
    with pytest.raises(StateError, match=says) as e:
        load_state(tmp_path)
    assert str(state_path(tmp_path)) in str(e.value) and "--fresh" in str(e.value)


def test_settings_diff_names_what_changed() -> None:
    saved = {"model": {"n_layers": 3, "d": 64}, "train": {"steps": 100}, "peers": 3}
    assert settings_diff(saved, json.loads(json.dumps(saved))) == []
    now = {"model": {"n_layers": 3, "d": 128}, "train": {"steps": 100}, "peers": 4}
    assert settings_diff(saved, now) == ["model.d: 64 -> 128", "peers: 3 -> 4"]


def test_forget_run_and_torn_metrics(tmp_path: Path) -> None:
    save_state(tmp_path, state())
    (tmp_path / "checkpoints" / "v00000010").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step", "step": 0}\n{"kind": "step", "st')
    assert read_events(tmp_path) == [{"kind": "step", "step": 0}]  # the torn line of a kill is skipped
    forget_run(tmp_path)
    assert load_state(tmp_path) is None and not (tmp_path / "checkpoints").exists()


def test_resume_claim_round_trips_and_rejects_bad_metadata() -> None:
    claim = ResumeClaim(
        run_id="demo", plan_version=2, stage=1, layer_start=1, layer_end=3, weight_version=41, generation=1, epoch=3
    )
    assert ResumeClaim.from_metadata([("x-other", "1"), *claim.metadata()]) == claim
    assert ResumeClaim.from_metadata([("x-other", "1")]) is None
    assert ResumeClaim.from_metadata(None) is None
    good = json.loads(claim.metadata()[0][1])
    for bad in (
        "{",
        "[]",
        json.dumps({**good, "stage": -1}),
        json.dumps({**good, "stage": True}),
        json.dumps({**good, "extra": 1}),
        json.dumps({**good, "run_id": 5}),
        "x" * 5000,
    ):
        with pytest.raises(ValueError, match=RESUME_KEY):
            ResumeClaim.from_metadata([(RESUME_KEY, bad)])


def test_undelivered_reports_merge_into_one_in_order() -> None:
    from peer.reports import merge_reports
    from swarm.pb import control_pb2 as cpb

    first = cpb.StatusReport(peer_id="p0", steps=[cpb.StepResult(step=20)], ready=True)
    merged = merge_reports(None, first)
    assert merged is not first  # a copy: the caller's message stays as it was
    merged = merge_reports(merged, cpb.StatusReport(peer_id="p0", steps=[cpb.StepResult(step=21)], error="x"))
    last = cpb.StatusReport(peer_id="p0", evals=[cpb.EvalResult(step=21)], finished=True, error="y")
    last.stats.weight_version = 22
    merged = merge_reports(merged, last)
    assert [s.step for s in merged.steps] == [20, 21] and [e.step for e in merged.evals] == [21]
    assert merged.ready and merged.finished and merged.error == "x" and merged.stats.weight_version == 22


def test_serve_refuses_a_corrupt_state_file_at_once(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "bad").mkdir()
    state_path(tmp_path / "bad").write_text("{not json")
    cmd = [sys.executable, "-m", "coordinator.cli", "serve", "--runs-dir", str(tmp_path), "--name", "bad"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "is not valid JSON" in out.stderr and "--fresh" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
