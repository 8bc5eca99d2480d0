"""Run a real Ravn swarm inside the swarm lab: every peer and the coordinator in its own namespace.

The processes are the ones a user runs (``ravn-coordinator serve``, ``ravn-peer join``), talking over
the lab's capped veth links; the run's metrics come back from ``runs/<name>/metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.lab import Lab

ROOT = Path(__file__).resolve().parent.parent
STAGE_PORT, DHT_PORT, CONTROL_PORT = 31400, 31401, 31337


@dataclass
class SwarmResult:
    name: str
    metrics: list[dict]
    wall_s: float
    output: str = field(repr=False, default="")

    @property
    def summary(self) -> dict:
        return next(m for m in self.metrics if m["kind"] == "summary")

    @property
    def steps(self) -> list[dict]:
        return [m for m in self.metrics if m["kind"] == "step"]

    @property
    def evals(self) -> list[dict]:
        return [m for m in self.metrics if m["kind"] == "eval"]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "THP_MEM_ALLOC_ENABLE": "1", "COLUMNS": "1000"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class _Reader:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True).start()

    def wait_for(self, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := rx.search(line):
                    return m
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"coordinator never printed {pattern!r}:\n{''.join(self.lines)}")


def run_swarm(
    lab: Lab, name: str, runs_dir: Path, train_args: list[str], *, threads: int = 1, timeout: float = 1800
) -> SwarmResult:
    """Coordinator in ``lab.coordinator``, one peer per lab peer host; returns when the run ends."""
    co, peers = lab.coordinator, lab.peers
    env = _env()
    t0 = time.monotonic()
    coord = co.popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--host",
            co.address,
            "--port",
            str(CONTROL_PORT),
            "--dht-port",
            str(DHT_PORT),
            "--peers",
            str(len(peers)),
            "--runs-dir",
            str(runs_dir),
            "--name",
            name,
            "--swarm",
            re.sub(r"[^a-z0-9-]", "-", name)[:32],
            "--heartbeat",
            "2",
            *train_args,
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    reader = _Reader(coord)
    m = reader.wait_for(r"RAVN_SWARM_TOKEN=(\S+) ravn-peer join (.*)$", coord, 120)
    join = [*m.group(2).split(), "--swarm-token", m.group(1)]
    procs = []
    for i, host in enumerate(peers):
        log = (runs_dir / f"{name}-p{i}.log").open("w")
        procs.append(
            host.popen(
                [
                    sys.executable,
                    "-m",
                    "peer.cli",
                    "join",
                    *join,
                    "--host",
                    host.address,
                    "--port",
                    str(STAGE_PORT),
                    "--dht-port",
                    str(DHT_PORT),
                    "--name",
                    f"p{i}",
                    "--threads",
                    str(threads),
                ],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        code = coord.wait(timeout=timeout)
    finally:
        for p in [coord, *procs]:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    output = "".join(reader.lines)
    if code != 0:
        raise RuntimeError(f"run {name} failed (exit {code}):\n{output}")
    metrics = [json.loads(x) for x in (runs_dir / name / "metrics.jsonl").read_text().splitlines()]
    return SwarmResult(name, metrics, time.monotonic() - t0, output)
