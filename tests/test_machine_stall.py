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


@pytest.mark.slow  # ~60 s: a start, training, an 8 s stall of every process and the rest of the run
def test_a_stall_of_every_process_longer_than_a_record_lives_costs_no_recovery(tmp_path: Path) -> None:
    cmd = ravn_cmd(
        "local",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "stall",
        "--model",
        "gpt-tiny",
        "--peers",
        "2",
        "--steps",
        "120",
        "--heartbeat",
        str(HEARTBEAT),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    metrics = tmp_path / "stall" / "metrics.jsonl"
    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while steps_done(metrics) < 5:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        stopped = descendants(proc.pid)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(STALL)  # the fault itself: every process of the swarm frozen
        for pid in reversed(stopped):
            os.kill(pid, signal.SIGCONT)
        stopped = []
        out, _ = proc.communicate(timeout=180)
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
    assert proc.returncode == 0, out
    assert "stopped heartbeating" not in out and "recovering:" not in out, out
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "membership"], out
    assert steps_done(metrics) == 120, out


@pytest.mark.slow  # ~70 s: a run whose one peer's DHT process stops for longer than a DHT round may take
def test_a_peer_whose_dht_stalls_past_its_timeout_keeps_announcing_itself(tmp_path: Path) -> None:
    """A peer's DHT process that stops answering for more than a DHT round's timeout (10 s) made that
    peer's announcement raise, which ended its heartbeat: its record expired for good while it trained on,
    and the coordinator dropped a live peer. With 5 s heartbeats a record lives 15 s, so a 12 s stall alone
    costs nothing."""
    cmd = ravn_cmd(
        "local",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "dht-stall",
        "--model",
        "gpt-tiny",
        "--peers",
        "2",
        "--steps",
        "1000",
        "--heartbeat",
        "5",
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    metrics = tmp_path / "dht-stall" / "metrics.jsonl"
    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while steps_done(metrics) < 5:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        peer = next(p for p in descendants(proc.pid) if b"peer-1" in Path(f"/proc/{p}/cmdline").read_bytes())
        stopped = descendants(peer)[1:]  # its DHT process and that one's p2p daemon, not the peer itself
        assert stopped, "the peer has no DHT process"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(12.0)  # the fault: past the DHT round's 10 s timeout, within the record's 15 s life
        for pid in reversed(stopped):
            os.kill(pid, signal.SIGCONT)
        stopped = []
        out, _ = proc.communicate(timeout=240)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            for pid in descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    assert proc.returncode == 0, out
    assert "stopped heartbeating" not in out and "recovering:" not in out, out
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "membership"], out
