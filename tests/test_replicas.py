"""Replicas on real processes: 4 peers, 3 blocks, the middle one held twice."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.conftest import ravn_cmd, read_metrics
from tests.swarm_procs import Proc
from tests.test_recovery import peer_pid

STEPS = 12


def _local(tmp: Path, name: str, *args: str) -> Proc:
    return Proc(
        ravn_cmd(
            "local",
            "--runs-dir",
            str(tmp),
            "--name",
            name,
            "--peers",
            "4",
            "--stages",
            "3",
            "--replicate",
            "1",
            "--micro-batches",
            "4",
            "--micro-batch-size",
            "2",
            "--eval-batches",
            "2",
            "--heartbeat",
            "1",
            *args,
        )
    )


def _replicas(proc: Proc) -> list[str]:
    _, plan = proc.wait_for(r"^plan: (.*)$", 180)
    blocks = dict(part.split("=") for part in plan.group(1).split(", "))
    middle = sorted(set(blocks.values()), key=lambda b: int(re.search(r"\[(\d+)", b).group(1)))[1]
    return sorted(p for p, b in blocks.items() if b == middle)


@pytest.mark.slow  # a whole swarm for a minute or more: keeps the default suite well under 10 minutes (CI)
def test_replicas_share_the_middle_block_and_agree_after_averaging(tmp_path: Path) -> None:
    proc = _local(
        tmp_path, "rep", "--steps", str(STEPS), "--eval-every", "6", "--average-every", "2", "--average-codec", "fp32"
    )
    try:
        replicas = _replicas(proc)
        assert len(replicas) == 2
        assert proc.wait(300) == 0, proc.output
    finally:
        proc.stop()
    metrics = read_metrics(tmp_path / "rep")
    summary = next(m for m in metrics if m["kind"] == "summary")
    stages = {st["peer"]: st for st in summary["stages"]}
    assert summary["steps"] == STEPS
    # each replica took a real share of the work, and together exactly every micro-batch
    shares = [stages[p]["forward_micro_batches"] for p in replicas]
    assert min(shares) > 0 and sum(shares) == STEPS * 4, shares
    # every holder of every block took one optimizer step per training step
    assert all(st["weight_version"] == STEPS for st in summary["stages"]), summary["stages"]
    # averaged every 2 steps plus once at the end; the agreed parameters are identical on both
    assert all(stages[p]["average_rounds"] >= STEPS // 2 for p in replicas)
    assert stages[replicas[0]]["anchor_digest"] == stages[replicas[1]]["anchor_digest"] != ""
    assert summary["replica_max_abs_diff"] is not None and summary["replica_max_abs_diff"] <= 1e-6
    assert summary["average_bytes"] > 0
    evals = [m["loss"] for m in metrics if m["kind"] == "eval"]
    assert evals[-1] < evals[0]


@pytest.mark.slow  # a whole swarm for over 20 s: keeps the default suite under 10 minutes
def test_sigkill_of_a_replica_during_averaging_keeps_the_swarm_training(tmp_path: Path) -> None:
    steps = 40
    proc = _local(
        tmp_path, "kill", "--steps", str(steps), "--eval-every", "10", "--average-every", "1", "--checkpoint-every", "5"
    )
    try:
        replicas = _replicas(proc)
        leader, victim = replicas
        proc.wait_for(r"^step 10: validation loss", 240)
        # averaging every step: the kill lands in or next to a round
        log = tmp_path / "kill" / "logs" / f"{victim}.log"
        assert "average round" in log.read_text()
        os.kill(peer_pid(proc, victim), signal.SIGKILL)  # our own peer, never another run's of the same name
        proc.wait_for(rf"replica {victim} of layers .* carry on without it", 60)
        assert proc.wait(300) == 0, proc.output
    finally:
        proc.stop()
    assert "recovered without" not in proc.output  # no restart from a checkpoint: the block was still held
    metrics = read_metrics(tmp_path / "kill")
    summary = next(m for m in metrics if m["kind"] == "summary")
    assert summary["steps"] == steps
    survivors = summary["stages"]
    assert victim not in {st["peer"] for st in survivors}
    assert all(st["weight_version"] == steps for st in survivors), survivors
    leader_log = (tmp_path / "kill" / "logs" / f"{leader}.log").read_text()
    # the leader either closed the interrupted round without the victim or had the plan update first;
    # either way no round hung and averaging stopped cleanly once it was the last holder
    assert re.search(r"average round \d+ applied \(peer-\d, peer-\d\)", leader_log)
    assert "averaging stops" in leader_log
    evals = [m["loss"] for m in metrics if m["kind"] == "eval"]
    assert evals[-1] < evals[0] and all(e == e for e in evals)


@pytest.mark.slow  # a whole swarm for a minute: keeps the default suite under 10 minutes
def test_async_with_replicas_applies_every_micro_batch_once_per_its_own_step(tmp_path: Path) -> None:
    """Two replicas return gradients out of order; before `0b9092b` the first stage stepped after any K of them
    and, under S = 1, dropped the ones overtaken by a later step's (1-5% in 300-step runs)."""
    steps, k = 40, 4
    proc = _local(
        tmp_path,
        "async",
        "--steps",
        str(steps),
        "--eval-every",
        "20",
        "--schedule",
        "async",
        "--max-staleness",
        "1",
        "--sync-steps",
        "0",
        "--warmup-steps",
        "0",
    )
    try:
        assert proc.wait(300) == 0, proc.output
    finally:
        proc.stop()
    metrics = read_metrics(tmp_path / "async")
    summary = next(m for m in metrics if m["kind"] == "summary")
    first = next(st for st in summary["stages"] if st["stage"] == 0)
    assert first["dropped"] == 0 and sum(first["staleness_counts"]) == steps * k, first
    assert len(first["staleness_counts"]) == 2 and first["staleness_counts"][1] > 0  # it did run async, S = 1
    assert all(st["weight_version"] == steps for st in summary["stages"]), summary["stages"]
    assert [m["step"] for m in metrics if m["kind"] == "step"] == list(range(steps))  # each step reported once
    # gradients held for their own step are in the summary: at most S = 1 set, less than the weights kept
    assert all(0 <= st["held_gradient_bytes_peak"] <= st["kept_weights_bytes_peak"] for st in summary["stages"])
