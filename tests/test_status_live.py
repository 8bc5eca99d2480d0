"""`ravn status` and the Prometheus endpoint against a live local swarm."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, ravn_cmd, read_metrics
from tests.swarm_procs import Proc, assert_all_gone


def watch_in_a_terminal(cmd: list[str], env: dict[str, str], seconds: float, until: str = "tok/s") -> str:
    """Run ``cmd`` under a pseudo-terminal until it draws ``until`` twice (or ``seconds``), then Ctrl-C it."""
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, "TERM": "xterm-256color"}, stdin=sub, stdout=sub, stderr=sub)
    os.close(sub)
    chunks: list[bytes] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and b"".join(chunks).count(until.encode()) < 2:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunks.append(os.read(main, 65536))
                except OSError:
                    break
        proc.send_signal(signal.SIGINT)
        # keep draining, as a terminal does: a full pty blocks the redraw thread and with it the exit
        exit_by = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < exit_by:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunks.append(os.read(main, 65536))
                except OSError:
                    break
        proc.wait(timeout=max(exit_by - time.monotonic(), 0.1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))


def test_status_and_metrics_of_a_running_swarm(tmp_path: Path) -> None:
    proc = Proc(
        ravn_cmd(
            "local",
            "--runs-dir",
            str(tmp_path),
            "--name",
            "live",
            "--peers",
            "2",
            "--model",
            "gpt-tiny",
            "--steps",
            "100000",
            "--eval-every",
            "5",
            "--eval-batches",
            "1",
            "--metrics-port",
            "0",
            "--error-feedback-backward",  # int8 gradients carry none under the default auto: shown per link
            "on",
        )
    )
    try:
        _, m = proc.wait_for(r"coordinator on (127\.0\.0\.1:\d+)", 120)
        target = m.group(1)
        _, metrics_url = proc.wait_for(r"Prometheus metrics on (http://\S+)", 30)
        proc.wait_for(r"step 10: validation loss", 180)
        tree = proc.tree()
        token = (tmp_path / "live" / "swarm.token").read_text().strip()
        denied = subprocess.run(
            ravn_cmd("status", "--coordinator", target), cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert denied.returncode == 3 and "requires a join token" in denied.stderr, denied.stderr
        auth_env = {**os.environ, "RAVN_SWARM_TOKEN": token}
        out = subprocess.run(
            ravn_cmd("status", "--coordinator", target, "--json"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env=auth_env,
        )
        status = json.loads(out.stdout)
        verdict = status["verdict"]
        assert verdict["level"] in ("healthy", "degraded"), verdict  # degraded while a peer is still warming up
        assert out.returncode == {"healthy": 0, "degraded": 1}[verdict["level"]], (out.returncode, verdict)
        assert (verdict["level"] == "degraded") == bool(verdict["problems"]), verdict  # degraded says why
        assert status["run"]["step"] >= 10 and status["run"]["val_loss"] is not None
        assert sorted(p["name"] for p in status["peers"]) == ["peer-0", "peer-1"]
        assigned = {tuple(m["layers"]) for m in read_metrics(tmp_path / "live") if m["kind"] == "assign"}
        blocks = sorted(tuple(b["layers"]) for b in status["blocks"])
        assert set(blocks) == assigned and blocks[0][0] == 0 and blocks[-1][1] == 3, (blocks, assigned)
        assert blocks[0][1] == blocks[1][0] and all(b["covered"] and b["replicas"] == 1 for b in status["blocks"])
        assert {tuple(p["block"]) for p in status["peers"]} == assigned, status["peers"]
        assert [(x["backward"], x["backward_error_feedback"]) for x in status["links"]] == [("int8", True)]
        table = subprocess.run(
            ravn_cmd("status", "--coordinator", target),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**auth_env, "COLUMNS": "160"},
        )
        assert re.search(r"healthy|degraded", table.stdout) and "peer-0" in table.stdout, table.stdout + table.stderr
        assert "int8 + error feedback" in table.stdout, table.stdout
        screen = watch_in_a_terminal(
            ravn_cmd("status", "--coordinator", target, "--watch", "--interval", "1"), auth_env, seconds=60
        )
        assert re.search(r"healthy|degraded", screen) and "peer-1" in screen and "tok/s" in screen, screen
        body = urllib.request.urlopen(metrics_url.group(1), timeout=10).read().decode()
        names = {f.name for f in text_string_to_metric_families(body)}
        assert any(n.startswith("ravn_") for n in names), sorted(names)[:20]
        proc.popen.send_signal(signal.SIGINT)
        assert proc.wait(90) == 130
    finally:
        proc.stop()
    assert_all_gone(tree)
    bad = subprocess.run(
        ravn_cmd("status", "--coordinator", "127.0.0.1:9", "--timeout", "2"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 3 and "error:" in bad.stderr and "Traceback" not in bad.stderr
