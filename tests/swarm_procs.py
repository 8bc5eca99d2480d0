"""Start ``ravn-coordinator serve`` and ``ravn-peer join`` as separate OS processes, and clean them up."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from swarm.allocator import peer_environment

ROOT = Path(__file__).resolve().parent.parent
# The allocator preloaded, as ``ravn local`` gives its peers: a peer then starts once, without re-executing
# itself (tests/test_allocator.py starts one that does).
ENV = peer_environment({**os.environ, "PYTHONUNBUFFERED": "1"})


class Proc:
    """A child process whose merged output is read by a thread, so waits have deadlines."""

    def __init__(self, args: list[str], log: Path | None = None) -> None:
        self.args = args
        self.popen = subprocess.Popen(
            args,
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._log = log
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.lines.append((time.monotonic(), line))
            if self._log is not None:
                with self._log.open("a") as f:
                    f.write(line)
        self._q.put(None)

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float) -> tuple[float, re.Match]:
        """(time seen, match) of the first output line matching ``pattern``."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        seen = 0
        while time.monotonic() < deadline:
            for t, line in self.lines[seen:]:
                m = rx.search(line)
                if m:
                    return t, m
            seen = len(self.lines)
            if self.popen.poll() is not None and seen == len(self.lines):
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s; output:\n{self.output}")

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def tree(self) -> list[int]:
        """This process and all its descendants (the DHT process, p2pd)."""
        return [self.popen.pid, *descendants(self.popen.pid)]

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM (a graceful leave), then SIGKILL after ``grace`` seconds."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pids: list[int]) -> list[int]:
    """PIDs still running (zombies count as gone)."""
    live = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            live.append(pid)
    return live


def assert_all_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"processes left behind: {alive(pids)}"


def coordinator(tmp: Path, *args: str) -> Proc:
    return Proc(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--port",
            "0",
            "--dht-port",
            "0",
            "--runs-dir",
            str(tmp),
            "--log-level",
            "WARNING",
            *args,
        ],
        log=tmp / "coordinator.out",
    )


def join_args(coord: Proc, timeout: float = 60) -> list[str]:
    """The join command the coordinator printed, as arguments (its token passed as --swarm-token)."""
    _, m = coord.wait_for(r"RAVN_SWARM_TOKEN=(\S+) ravn-peer join (.*)$", timeout)
    return [*m.group(2).split(), "--swarm-token", m.group(1)]


def peer(tmp: Path, join: list[str], name: str, *args: str) -> Proc:
    return Proc([sys.executable, "-m", "peer.cli", "join", *join, "--name", name, *args], log=tmp / f"{name}.out")
