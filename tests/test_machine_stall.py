"""A stall of the whole machine does not cost the run a recovery.

Seen in a real run (docs/hf_scale.md): every process of ``ravn local`` stopped for 12-18 s at once (a
loaded 2-core machine). Peer records live three heartbeats (6 s at ``ravn local``'s 2 s), so when the
coordinator woke, every record had expired although every peer was alive and its control stream open; it
declared them gone ("stopped heartbeating") and recovered from the last checkpoint. A gaming PC that
stalls (a game loading, swap) is the same case. Here every process of the swarm is stopped for longer
than a record lives, and the run must carry on without an incident.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ROOT, ravn_cmd

HEARTBEAT = 1.0  # records live 3 s
STALL = 8.0  # longer than a record lives, shorter than anything else waits


def descendants(root: int) -> list[int]:
    """``root``'s process tree (children before their parents' turn does not matter for SIGSTOP)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def steps_done(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"kind": "step"' in line)


def run_with_a_stall(
    tmp_path: Path, name: str, *, steps: int, heartbeat: float, stall: float, frozen: Callable[[int], list[int]]
) -> tuple[int, str, Path]:
    """``ravn local`` with 2 peers; after 5 steps the processes ``frozen(ravn_local_pid)`` names are stopped
    for ``stall`` seconds (the fault itself, not a wait), then the run goes to its end. Returns the exit
    code, the output and the metrics file; every process is resumed and, if still running, killed."""
    cmd = ravn_cmd(
        "local",
        "--runs-dir",
        str(tmp_path),
        "--name",
        name,
        "--model",
        "gpt-tiny",
        "--peers",
        "2",
        "--steps",
        str(steps),
        "--heartbeat",
        str(heartbeat),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    metrics = tmp_path / name / "metrics.jsonl"
    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while steps_done(metrics) < 5:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        stopped = frozen(proc.pid)
        assert stopped, "nothing to stop"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(stall)
        for pid in reversed(stopped):
            os.kill(pid, signal.SIGCONT)
        stopped = []
        out, _ = proc.communicate(timeout=240)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            for pid in descendants(proc.pid):  # peers run in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    return proc.returncode, out, metrics


def assert_no_incident(code: int, out: str, metrics: Path) -> None:
    assert code == 0, out
    assert "stopped heartbeating" not in out and "recovering:" not in out, out
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "membership"], out


@pytest.mark.slow  # ~35 s: a start, training, an 8 s stall of every process and the rest of the run
def test_a_stall_of_every_process_longer_than_a_record_lives_costs_no_recovery(tmp_path: Path) -> None:
    code, out, metrics = run_with_a_stall(
        tmp_path, "stall", steps=120, heartbeat=HEARTBEAT, stall=STALL, frozen=descendants
    )
    assert_no_incident(code, out, metrics)
    assert steps_done(metrics) == 120, out


def dht_of_peer_1(root: int) -> list[int]:
    """peer-1's DHT process and that one's p2p daemon, not the peer itself."""
    peer = next(p for p in descendants(root) if b"peer-1" in Path(f"/proc/{p}/cmdline").read_bytes())
    return descendants(peer)[1:]


@pytest.mark.slow  # ~70 s: a run whose one peer's DHT process stops for longer than a DHT round may take
def test_a_peer_whose_dht_stalls_past_its_timeout_keeps_announcing_itself(tmp_path: Path) -> None:
    """A peer's DHT process that stops answering for more than a DHT round's timeout (10 s) made that
    peer's announcement raise, which ended its heartbeat: its record expired for good while it trained on,
    and the coordinator dropped a live peer. With 5 s heartbeats a record lives 15 s, so a 12 s stall alone
    costs nothing (past the DHT round's 10 s timeout, within the record's life)."""
    code, out, metrics = run_with_a_stall(
        tmp_path, "dht-stall", steps=1000, heartbeat=5.0, stall=12.0, frozen=dht_of_peer_1
    )
    assert_no_incident(code, out, metrics)
