"""`ravn status` while a swarm loses a peer: degraded, naming the block, until it trains again; then healthy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, ravn_cmd
from tests.swarm_procs import assert_all_gone, coordinator, join_args, peer


def status(target: str, token: str) -> dict:
    """One `ravn status --json` as a script would run it."""
    out = subprocess.run(
        ravn_cmd("status", "--coordinator", target, "--json", "--timeout", "10"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RAVN_SWARM_TOKEN": token},
    )
    assert out.returncode in (0, 1, 2), out.stderr
    return json.loads(out.stdout)


def poll(target: str, token: str, ok, timeout: float, what: str) -> dict:
    """Poll `ravn status --json` until ``ok(status)``; the verdict lines seen are in the failure message."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        st = status(target, token)
        seen.append(st["verdict"]["line"])
        if ok(st):
            return st
    raise AssertionError(f"no status with {what} within {timeout} s; verdicts seen: {seen}")


@pytest.mark.slow  # a whole swarm for over 20 s: keeps the default suite under 10 minutes
def test_sigkill_of_a_peer_turns_the_verdict_degraded_and_names_its_block(tmp_path: Path) -> None:
    coord = coordinator(
        tmp_path,
        "--peers",
        "3",
        "--model",
        "gpt-tiny",
        "--heartbeat",
        "5",
        "--steps",
        "100000",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "1000",
        "--micro-batches",
        "2",
        "--name",
        "deg",
    )
    procs = {"coordinator": coord}
    paused = False
    try:
        join = join_args(coord)
        _, m = coord.wait_for(r"coordinator of swarm '\w+' on (127\.0\.0\.1:\d+)", 10)
        target, token = m.group(1), (tmp_path / "ravn.token").read_text().strip()
        for name in ("p0", "p1", "p2"):  # slowish peers: steps take seconds
            procs[name] = peer(tmp_path, join, name, "--heartbeat", "5", "--threads", "1", "--debug-slowdown", "0.5")
        _, plan = coord.wait_for(r"^plan: (.*)$", 180)
        blocks = {p: part.split("=")[1] for part in plan.group(1).split(", ") for p in [part.split("=")[0]]}
        victim = list(blocks)[1]  # a middle stage
        layers = [int(x) for x in blocks[victim].removeprefix("layers[").removesuffix(")").split(",")]
        poll(target, token, lambda s: s["verdict"]["level"] == "healthy" and s["run"]["step"] >= 2, 240, "healthy")
        tree = [pid for p in procs.values() for pid in p.tree()]
        # hold the recovery open while we look: a paused survivor cannot restore its new block yet (its record
        # expires only after 3 heartbeats of 5 s, its gRPC keepalive after about 15 s)
        survivor = procs[list(blocks)[-1]].popen.pid
        os.kill(survivor, signal.SIGSTOP)
        paused = True
        os.kill(procs[victim].popen.pid, signal.SIGKILL)
        degraded = poll(
            target,
            token,
            lambda s: (
                s["verdict"]["level"] == "degraded" and any(p["block"] == layers for p in s["verdict"]["problems"])
            ),
            30,
            f"a degraded verdict naming layers {layers}",
        )
        os.kill(survivor, signal.SIGCONT)
        paused = False
        line = degraded["verdict"]["line"]
        assert f"layers [{layers[0]},{layers[1]})" in line and f"lost peer {victim}" in line, line
        assert degraded["run"]["recovering_layers"] == layers and not degraded["run"]["failure"]
        coord.wait_for(rf"recovered without {victim}", 60)
        poll(target, token, lambda s: s["verdict"]["level"] == "healthy", 120, "healthy again after the recovery")
        coord.popen.send_signal(signal.SIGINT)
        assert coord.wait(90) == 130, coord.output
    finally:
        if paused:
            os.kill(survivor, signal.SIGCONT)
        for p in procs.values():
            p.stop()
    assert_all_gone(tree)
