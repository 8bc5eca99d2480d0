"""The async schedule on real peer processes: staleness stays bounded, a slow peer throttles admissions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_ravn_local

K = 2


def summary(run_dir: Path) -> dict:
    return next(m for m in read_metrics(run_dir) if m["kind"] == "summary")


def test_staleness_never_exceeds_the_bound_and_the_sync_steps_send_nothing_late(tmp_path: Path) -> None:
    sync_steps = 8
    run_ravn_local(
        tmp_path,
        "s2",
        "--peers",
        "3",
        "--model",
        "gpt-small",
        "--steps",
        "24",
        "--schedule",
        "async",
        "--warmup-steps",
        "2",  # the warm-up and the sync steps run synchronously: keep them short of these short runs
        "--sync-steps",
        str(sync_steps),
        "--max-staleness",
        "2",
        "--max-in-flight",
        "0",  # the full window: what the measured pipe window (S >= 2) admits from
        "--micro-batches",
        str(K),
        "--micro-batch-size",
        "2",
        "--eval-every",
        "0",
        "--eval-batches",
        "2",
    )
    s = summary(tmp_path / "s2")
    stages = s["stages"]
    assert len(stages) == 3
    for st in stages:
        assert len(st["staleness_counts"]) <= 3, f"stage {st['stage']} applied a gradient with staleness > 2: {st}"
        assert st["dropped"] == 0
        assert st["in_flight_peak"] <= 3 * K
    late = sum(stages[0]["staleness_counts"][1:])
    assert late > 0, "the first stage never overlapped steps: not asynchronous"
    assert late <= (24 - sync_steps) * K, "a micro-batch of the sync steps came back late"
    losses = [m["loss"] for m in read_metrics(tmp_path / "s2") if m["kind"] == "step"]
    assert len(losses) == 24 and min(losses[-4:]) < losses[0] - 1.0


@pytest.mark.slow  # the staleness-bound test above runs the same admission path by default
def test_a_slow_peer_throttles_admissions(tmp_path: Path) -> None:
    run_ravn_local(
        tmp_path,
        "slow",
        "--peers",
        "3",
        "--model",
        "gpt-tiny",
        "--steps",
        "12",
        "--schedule",
        "async",
        "--warmup-steps",
        "2",  # the warm-up and the sync steps run synchronously: keep them short of these short runs
        "--sync-steps",
        "2",
        "--max-staleness",
        "1",
        "--micro-batches",
        str(K),
        "--micro-batch-size",
        "2",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--debug-slow-peer",
        "1:0.1",
    )
    s = summary(tmp_path / "slow")
    limit = K  # async's default cap: sync's activations
    for st in s["stages"]:
        assert st["in_flight_peak"] <= limit, st
        assert len(st["staleness_counts"]) <= 2 and st["dropped"] == 0
    # the data source hit the cap (it was throttled) and never went past it: memory stays bounded
    assert s["stages"][0]["in_flight_peak"] == limit, s["stages"][0]
