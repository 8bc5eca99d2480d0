"""Shared helpers for tests that start real Ravn processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import swarm  # noqa: F401  (before any test module loads gRPC: it sets gRPC's fork mode)

ROOT = Path(__file__).resolve().parent.parent


def ravn_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.ravn_cli", *args]


def run_ravn_local(runs_dir: Path, name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``ravn local`` to completion as a user would, failing loudly with its output."""
    cmd = ravn_cmd("local", "--runs-dir", str(runs_dir), "--name", name, *args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if proc.returncode != 0:
        logs = "\n".join(p.read_text()[-2000:] for p in sorted((runs_dir / name / "logs").glob("*.log")))
        pytest.fail(f"ravn local exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\n{logs}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# On CI (.ci/run sets RAVN_CI=1) a skipped test fails the run: CI installs everything the tests need
# (nftables, iproute2, the hf extras, root for the lab), so a skip there means a test silently stopped
# running. Only skips for hardware no CI machine has are allowed.
CI_ALLOWED_SKIPS = ("needs a CUDA device",)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("RAVN_CI") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [r for r in (reporter.stats.get("skipped", []) if reporter else []) if not hasattr(r, "wasxfail")]
    reasons = [f"{r.nodeid}: {r.longrepr[2] if isinstance(r.longrepr, tuple) else r.longrepr}" for r in skipped]
    refused = [x for x in reasons if not any(allowed in x for allowed in CI_ALLOWED_SKIPS)]
    if refused:
        reporter.write_line(f"RAVN_CI: {len(refused)} test(s) skipped; CI must provide what they need:", red=True)
        for line in refused:
            reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
