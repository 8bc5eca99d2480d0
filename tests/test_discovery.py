"""Discovery through the DHT with real, separate processes: join, train, crash, leave, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.allocator import peer_environment
from tests.conftest import read_metrics
from tests.swarm_procs import ROOT, assert_all_gone, coordinator, join_args, peer

HEARTBEAT = 1.0


@pytest.mark.slow  # a whole swarm for over 20 s: keeps the default suite under 10 minutes
def test_four_separate_peers_train_and_a_crash_uncovers_its_block(tmp_path: Path) -> None:
    coord = coordinator(
        tmp_path,
        "--peers",
        "4",
        "--heartbeat",
        str(HEARTBEAT),
        "--steps",
        "100000",
        "--micro-batches",
        "2",
        "--micro-batch-size",
        "2",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "0",
        "--name",
        "four",
    )
    procs = [coord]
    try:
        join = join_args(coord)
        assert "--coordinator-key" in join and "--swarm" in join
        procs += [peer(tmp_path, join, f"p{i}", "--heartbeat", str(HEARTBEAT), "--threads", "1") for i in range(4)]
        _, m = coord.wait_for(r"plan: (.*)", 120)
        assert sorted(part.split("=")[0] for part in m.group(1).split(", ")) == ["p0", "p1", "p2", "p3"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            losses = [x["loss"] for x in read_metrics(tmp_path / "four") if x["kind"] == "step"]
            if len(losses) >= 30 and min(losses[-5:]) < losses[0] - 0.5:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the loss did not fall: {losses}\n{coord.output}")

        victim = procs[3]  # p2: a middle stage
        victim_tree = victim.tree()
        assert len(victim_tree) >= 3, "a peer runs a DHT process and its p2pd"
        victim.popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        seen, m = coord.wait_for(
            r"membership: peer p2 stopped heartbeating.*layers \[(\d+),(\d+)\) are now uncovered", 30
        )
        assert seen - killed <= 3 * HEARTBEAT + 2.0, f"expiry noticed after {seen - killed:.1f} s"
        assert_all_gone(victim_tree)  # its DHT process and p2pd died with it
        assert coord.wait(60) != 0
        assert "are uncovered" in coord.output
        events = [x for x in read_metrics(tmp_path / "four") if x["kind"] == "membership"]
        assert events and events[0]["peer"] == "p2" and events[0]["event"] == "expired"
    finally:
        tree = [pid for p in procs for pid in p.tree()]
        for p in procs:
            p.stop()
        assert_all_gone(tree)


def test_graceful_leave_is_visible_at_once(tmp_path: Path) -> None:
    coord = coordinator(
        tmp_path,
        "--peers",
        "2",
        "--heartbeat",
        str(HEARTBEAT),
        "--steps",
        "100000",
        "--model",
        "gpt-tiny",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "0",
        "--name",
        "leave",
    )
    procs = [coord]
    try:
        join = join_args(coord)
        procs += [peer(tmp_path, join, f"q{i}", "--heartbeat", str(HEARTBEAT), "--threads", "1") for i in range(2)]
        coord.wait_for(r"step \d+/", 120)
        procs[2].popen.send_signal(signal.SIGTERM)
        left = time.monotonic()
        seen, _ = coord.wait_for(r"membership: peer q1 left gracefully", 30)
        assert seen - left <= HEARTBEAT + 2.0, f"graceful leave noticed after {seen - left:.1f} s"
        assert procs[2].wait(30) == 0
    finally:
        tree = [pid for p in procs for pid in p.tree()]
        for p in procs:
            p.stop()
        assert_all_gone(tree)


def run_peer_cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    # read now, not at import: the caller may have set RAVN_* with monkeypatch; the allocator as a peer gets it
    env = peer_environment({**os.environ, "COLUMNS": "400"})  # one-line errors stay one line in rich's boxes
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "join", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, text: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert text in proc.stderr, proc.stderr


@pytest.mark.slow  # each case starts a peer CLI and its DHT node (about 30 s in all)
def test_join_mistakes_get_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coord = coordinator(tmp_path, "--peers", "1", "--swarm", "right", "--model", "gpt-tiny", "--name", "errs")
    try:
        join = join_args(coord)
        monkeypatch.setenv("RAVN_SWARM_TOKEN", join[join.index("--swarm-token") + 1])
        key = join[join.index("--coordinator-key") + 1]
        maddr = join[join.index("--initial-peers") + 1]
        assert_one_line_error(
            run_peer_cli("--swarm", "right", "--initial-peers", "not-a-multiaddr", "--coordinator-key", key),
            "is not a multiaddr",
        )
        unreachable = "/ip4/127.0.0.1/tcp/9/p2p/" + maddr.rsplit("/", 1)[1]
        assert_one_line_error(
            run_peer_cli("--swarm", "right", "--initial-peers", unreachable, "--coordinator-key", key),
            "cannot reach any initial peer",
        )
        assert_one_line_error(
            run_peer_cli("--swarm", "wrong", "--initial-peers", maddr, "--coordinator-key", key, "--find-timeout", "5"),
            "no coordinator of swarm 'wrong'",
        )
        assert_one_line_error(
            run_peer_cli("--swarm", "Bad Name!", "--initial-peers", maddr, "--coordinator-key", key),
            "invalid swarm name",
        )
        assert_one_line_error(run_peer_cli("--swarm", "right"), "missing --initial-peers, --coordinator-key")
        assert_one_line_error(
            run_peer_cli("--swarm", "right", "--initial-peers", maddr, "--coordinator-key", "nonsense"),
            "--coordinator-key is not a public key",
        )
    finally:
        tree = coord.tree()
        coord.stop()
        assert_all_gone(tree)
