"""``ravn-coordinator serve`` and independent ``ravn-peer join`` processes, as on separate machines."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, read_metrics


def test_coordinator_and_peers_as_separate_commands(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    coord = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--peers",
            "2",
            "--port",
            "0",
            "--model",
            "gpt-tiny",
            "--steps",
            "8",
            "--eval-every",
            "0",
            "--eval-batches",
            "1",
            "--runs-dir",
            str(tmp_path),
            "--name",
            "sep",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    peers: list[subprocess.Popen] = []
    try:
        join = None
        deadline = time.monotonic() + 60
        lines = []
        while join is None and time.monotonic() < deadline:
            line = coord.stdout.readline()
            lines.append(line)
            m = re.search(r"ravn-peer join (--coordinator \S+)", line)
            join = m.group(1).split() if m else None
        assert join, "".join(lines)
        for i in range(2):
            peers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "peer.cli", "join", *join, "--name", f"p{i}"],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        out, _ = coord.communicate(timeout=180)
        assert coord.returncode == 0, "".join(lines) + out
        for p in peers:
            assert p.wait(timeout=30) == 0
    finally:
        for p in [coord, *peers]:
            if p.poll() is None:
                p.kill()
                p.wait()
    steps = [m for m in read_metrics(tmp_path / "sep") if m["kind"] == "step"]
    assert len(steps) == 8 and steps[-1]["loss"] < steps[0]["loss"]
    assert (tmp_path / "sep" / "model.safetensors").exists()


def test_peer_on_all_interfaces_must_announce() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "peer.cli", "join", "--coordinator", "127.0.0.1:1", "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "--announce" in proc.stderr and "Traceback" not in proc.stderr
