"""``ravn-coordinator serve`` with peers that offer too little memory: it says so in one line and waits (#18).

A peer joined with ``--memory 1KiB`` can hold no layer: the coordinator logs the memory needed and offered,
``ravn status`` shows it, and the run starts as soon as a peer that can hold the model joins.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm_procs import ENV, ROOT, assert_all_gone, coordinator, join_args, peer


def _status(port: str, token: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.ravn_cli", "status", "--coordinator", f"127.0.0.1:{port}", "--json"],
        cwd=ROOT,
        env={**ENV, "RAVN_SWARM_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(proc.stdout)


@pytest.mark.slow  # a real run; the default suite keeps newcomers under 10 minutes
def test_serve_waits_for_a_peer_that_fits(tmp_path: Path) -> None:
    coord = coordinator(
        tmp_path,
        "--model",
        "gpt-tiny",
        "--peers",
        "1",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--heartbeat",
        "0.5",
        "--name",
        "fit",
    )
    procs = [coord]
    try:
        join = join_args(coord)
        token = join[join.index("--swarm-token") + 1]
        _, port = coord.wait_for(r"on 127\.0\.0\.1:(\d+)", 30)
        procs.append(peer(tmp_path, join, "small", "--memory", "1KiB", "--heartbeat", "0.5"))
        _, m = coord.wait_for(r"waiting for more peers or memory: (.*)$", 120)
        line = m.group(1)
        assert "no plan fits the peers' memory" in line and "the peers offer small 1 KiB" in line, line
        assert "Traceback" not in coord.output
        status = _status(port.group(1), token)
        assert "no plan fits the peers' memory" in status["run"]["waiting"], status
        assert "no plan fits the peers' memory" in status["verdict"]["line"], status
        assert procs[1].popen.poll() is None, "the small peer waits too"

        procs.append(peer(tmp_path, join, "big", "--heartbeat", "0.5"))
        coord.wait_for(r"can hold a layer: planning again", 60)
        coord.wait_for(r"^plan: big=layers\[0,", 30)
        assert coord.wait(180) == 0, coord.output
        assert coord.output.count("waiting for more peers or memory") == 1, "said once, not every heartbeat"
    finally:
        pids = [pid for p in procs for pid in p.tree()]
        for p in reversed(procs):
            p.stop()
        assert_all_gone(pids)
