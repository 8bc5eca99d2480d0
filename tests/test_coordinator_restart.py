"""A coordinator killed mid-run and started again with the same command: the swarm trains on, re-attaches,
and the run ends with the same plan and a continuous step count (every step logged exactly once)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.swarm_procs import assert_all_gone, coordinator, join_args, peer

STEPS = 120


@pytest.mark.slow  # a whole swarm for over 20 s: keeps the default suite under 10 minutes
def test_sigkill_of_the_coordinator_then_restart_trains_on_with_the_same_plan(tmp_path: Path) -> None:
    args = (
        "--peers",
        "3",
        "--model",
        "gpt-tiny",
        "--heartbeat",
        "1",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "10",
        "--eval-every",
        "10",
        "--eval-batches",
        "1",
        "--micro-batches",
        "2",
        "--name",
        "restart",
    )
    first = coordinator(tmp_path, *args)
    procs = [first]
    tree: list[int] = []
    try:
        join = join_args(first)
        for name in ("p0", "p1", "p2"):
            procs.append(peer(tmp_path, join, name, "--heartbeat", "1", "--threads", "1", "--debug-slowdown", "0.05"))
        _, plan = first.wait_for(r"^plan: (.*)$", 180)
        first.wait_for(r"step 20: validation loss", 240)
        tree = [pid for p in procs for pid in p.tree()]
        first_tree = first.tree()
        os.kill(first.popen.pid, signal.SIGKILL)
        assert_all_gone(first_tree)  # its DHT process and p2pd too: the restart reuses their ports
        t0 = time.monotonic()
        second = coordinator(tmp_path, *args)
        procs.append(second)
        _, resumed = second.wait_for(r"resuming run 'restart' from its saved state: plan v\d+ (.*); (\d+) steps", 120)
        assert resumed.group(1) == plan.group(1), "the restarted coordinator must keep the plan"
        attached_at, _ = second.wait_for(r"re-attached all 3 peers: training goes on", 120)
        print(f"swarm re-attached {attached_at - t0:.1f} s after the coordinator was started again")
        assert second.wait(300) == 0, second.output
        for p in procs[1:4]:
            assert p.wait(60) == 0, p.output
        tree += second.tree()
    finally:
        for p in procs:
            p.stop()
    assert_all_gone(tree)
    metrics = read_metrics(tmp_path / "restart")
    steps = [m["step"] for m in metrics if m["kind"] == "step"]
    assert steps == list(range(STEPS)), f"steps missing or counted twice: {sorted(set(range(STEPS)) ^ set(steps))}"
    assert not [m for m in metrics if m["kind"] == "recovery"], "a coordinator restart must not restart training"
    resume = next(m for m in metrics if m["kind"] == "resume")
    after = [m for m in metrics if m["kind"] == "step" and m["time"] > resume["time"]]
    assert after, "training went on after the swarm re-attached"
    summary = [m for m in metrics if m["kind"] == "summary"][-1]
    assert summary["steps"] == STEPS and all(st["weight_version"] == STEPS for st in summary["stages"])
    run_dir = tmp_path / "restart"
    assert (run_dir / "model.safetensors").exists() and (run_dir / "loss.png").exists()
    assert re.search(r"checkpoint: .*model\.safetensors", second.output)


@pytest.mark.slow  # the default suite's TLS/restart test covers the same path; this one adds a variant
def test_a_peer_leaves_when_the_coordinator_does_not_come_back_within_its_grace(tmp_path: Path) -> None:
    coord = coordinator(tmp_path, "--peers", "1", "--model", "gpt-tiny", "--heartbeat", "1", "--steps", "100000")
    procs = [coord]
    try:
        p0 = peer(tmp_path, join_args(coord), "p0", "--heartbeat", "1", "--coordinator-grace", "3")
        procs.append(p0)
        coord.wait_for(r"^step \d+/100000", 180)
        tree = [pid for p in procs for pid in p.tree()]
        os.kill(coord.popen.pid, signal.SIGKILL)
        p0.wait_for(r"lost the coordinator .* training on and redialling for up to 3 s", 30)
        assert p0.wait(60) == 2
        assert "did not come back within 3 s (--coordinator-grace); leaving the swarm" in p0.output
    finally:
        for p in procs:
            p.stop()
    assert_all_gone(tree)
