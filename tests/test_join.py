"""A peer that joins a running swarm is placed by the planner, with no step lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.swarm_procs import assert_all_gone, coordinator, join_args, peer


def tokens_per_s(steps: list[dict]) -> float:
    return sum(m["tokens"] for m in steps) / sum(m["seconds"] for m in steps)


@pytest.mark.slow  # a whole swarm for over 20 s: keeps the default suite under 10 minutes
def test_a_joining_peer_is_placed_and_nothing_is_lost(tmp_path: Path) -> None:
    coord = coordinator(
        tmp_path,
        "--peers",
        "1",
        "--heartbeat",
        "1",
        "--steps",
        "120",
        "--checkpoint-every",
        "10",
        "--eval-every",
        "20",
        "--eval-batches",
        "2",
        "--name",
        "join",
        "--micro-batches",
        "4",
    )
    procs = [coord]
    try:
        join = join_args(coord)
        procs.append(peer(tmp_path, join, "first", "--heartbeat", "1", "--threads", "1"))
        coord.wait_for(r"^step \d+/120", 120)
        coord.wait_for(r"step 20: validation loss", 120)
        procs.append(peer(tmp_path, join, "second", "--heartbeat", "1", "--threads", "1"))
        _, m = coord.wait_for(
            r"recovered without losing a peer: plan (.*); resuming from step (\d+) \((\d+) steps", 120
        )
        assert "first=" in m.group(1) and "second=" in m.group(1)
        assert int(m.group(3)) == 0, "a join must not lose steps"
        assert coord.wait(300) == 0, coord.output
        tree = [pid for p in procs for pid in p.tree()]
    finally:
        for p in procs:
            p.stop()
    assert_all_gone(tree)
    metrics = read_metrics(tmp_path / "join")
    join_event = next(m for m in metrics if m["kind"] == "join")
    recovery = next(m for m in metrics if m["kind"] == "recovery")
    assert join_event["peers"] == ["second"] and join_event["predicted_gain"] > 0.05
    steps = [m for m in metrics if m["kind"] == "step"]
    before = [m for m in steps if m["time"] < join_event["time"]][-10:]
    after = [m for m in steps if m["time"] > recovery["time"]][5:]
    # measured, not asserted: on a shared 2-core machine the ratio depends on what else runs (1.34x on a
    # quiet one, 0.89x under a parallel test run); docs/fault_tolerance.md reports it
    print(f"tokens/s before the join {tokens_per_s(before):.0f}, after {tokens_per_s(after):.0f}")
    summary = next(m for m in metrics if m["kind"] == "summary")
    assert len(summary["stages"]) == 2 and all(st["weight_version"] == 120 for st in summary["stages"])
