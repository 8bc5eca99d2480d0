"""Thin wrappers around `ip netns` / `ip link`: create, list, empty and delete lab namespaces.

Lab namespaces are named `<prefix>-<pid>x<rand>-<host>`, so two labs never collide, a crashed run's
leftovers can be recognised by prefix, and `cleanup_stale` can tell whether the owning process is
still alive (and leave a concurrently running lab alone).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

PREFIX = "ravnlab"
_NAME_RE = re.compile(r"^(?P<prefix>[a-z]+)-(?P<pid>\d+)x(?P<rand>[0-9a-f]+)-(?P<host>[a-z0-9]+)$")


class LabError(RuntimeError):
    """An `ip`/`tc` command failed; carries the command and its stderr so setup errors are readable."""


def run_cmd(argv: Sequence[str], timeout: float = 15.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run an iproute2 command, raising `LabError` with its stderr on failure."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(argv)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def new_lab_id() -> str:
    """Unique per lab instance: owner pid (for stale detection) plus randomness (for two labs in one pid)."""
    return f"{os.getpid()}x{secrets.token_hex(3)}"


def netns_name(prefix: str, lab_id: str, host: str) -> str:
    """Namespace name for one host of one lab."""
    return f"{prefix}-{lab_id}-{host}"


def unavailable_reason() -> str | None:
    """Why the lab cannot run here (not root, no iproute2, no namespaces), or None when it can.

    Tests use this to skip with a clear message instead of failing on a developer laptop.
    """
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = netns_name(PREFIX, new_lab_id(), "probe")
    try:
        run_cmd(["ip", "netns", "add", probe], timeout=10)
    except LabError as exc:
        return f"`ip netns add` does not work here: {exc}"
    try:
        shape = ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
                 "burst", "16384", "limit", "32768"]  # fmt: skip
        if run_cmd(shape, check=False).returncode != 0:
            return "`tc qdisc ... tbf` does not work here (sch_tbf missing?)"
    finally:
        run_cmd(["ip", "netns", "del", probe], check=False)
    return None


def list_netns(prefix: str = PREFIX) -> list[str]:
    """Names of existing namespaces created by a lab with this prefix."""
    out = run_cmd(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def netns_pids(name: str) -> list[int]:
    """Processes currently running inside a namespace (empty if it is gone)."""
    proc = run_cmd(["ip", "netns", "pids", name], check=False)
    if proc.returncode != 0:
        return []
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def kill_netns_processes(name: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL everything inside a namespace and wait until it is empty.

    This is the safety net behind the per-process shutdown: a process that daemonised or changed its
    session is still found here, and a namespace with processes left would outlive `ip netns del`.
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while pids := [p for p in netns_pids(name) if p != os.getpid()]:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise LabError(f"processes {pids} in {name} survived SIGKILL")
        time.sleep(0.02)  # a killed process needs its parent to reap it; poll until it is gone
    return killed


def delete_netns(name: str) -> None:
    """Empty and delete one namespace; its veth ends and bridges go with it. Missing is fine."""
    kill_netns_processes(name)
    proc = run_cmd(["ip", "netns", "del", name], check=False)
    if proc.returncode != 0 and name in list_netns(name.split("-", 1)[0]):
        raise LabError(f"ip netns del {name} failed: {proc.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(name: str) -> bool:
    """Whether the process that made this lab object (a namespace, a CPU share) still runs."""
    match = _NAME_RE.match(name)
    return bool(match) and _pid_alive(int(match.group("pid")))


def cleanup_stale(prefix: str = PREFIX, include_live: bool = False) -> list[str]:
    """Delete namespaces left by labs whose owning process died (or all of them with `include_live`).

    Returns the deleted names. A lab still running in another process is left alone by default, so
    this is safe to call at the start of every run.
    """
    removed = []
    for name in list_netns(prefix):
        if not include_live and owner_alive(name):
            continue
        delete_netns(name)
        removed.append(name)
    return removed
