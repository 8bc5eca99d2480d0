"""Start processes inside a namespace, wait for them to report readiness, and stop them for sure.

Every lab process gets its own session (so stopping it also stops whatever it spawned) and a parent
death signal (so a lab owner killed with SIGKILL does not leave relays or peers running).
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def netns_argv(netns: str, cmd: Sequence[str]) -> list[str]:
    """argv that runs `cmd` inside `netns` (`ip netns exec` execs it, so the pid stays the same)."""
    return ["ip", "netns", "exec", netns, *cmd]


def python_module_argv(module: str, *args: str) -> list[str]:
    """argv for one of the lab's own helpers, run with this interpreter."""
    return [sys.executable, "-m", module, *args]


def lab_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment that can import `benchmarks.lab` (it is not an installed package)."""
    merged = dict(os.environ if env is None else env)
    path = merged.get("PYTHONPATH", "")
    if str(REPO_ROOT) not in path.split(os.pathsep):
        merged["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)
    return merged


def spawn(
    argv: Sequence[str],
    die_with_parent: bool = True,
    before_exec: Callable[[], None] | None = None,
    **popen_kwargs,
) -> subprocess.Popen:
    """Popen in a new session; with `die_with_parent` it gets SIGTERM if the spawning thread dies.

    The parent death signal is tied to the *thread* that spawned the process: spawn long-lived
    processes from a thread that lives as long as the lab (normally the main thread). `before_exec`
    runs in the child before the command (e.g. joining a CPU share, so everything it starts is in it).
    """
    if die_with_parent or before_exec:

        def setup() -> None:
            if die_with_parent:
                _die_with_parent()
            if before_exec:
                before_exec()

        popen_kwargs.setdefault("preexec_fn", setup)
    popen_kwargs.setdefault("start_new_session", True)
    proc = subprocess.Popen(list(argv), **popen_kwargs)
    proc.lab_own_group = bool(popen_kwargs["start_new_session"])  # type: ignore[attr-defined]
    return proc


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """Next stdout line of `proc` (opened with stdout=PIPE), failing after `timeout` or if it exits.

    Lab helpers print `READY <port>` once they listen; waiting for that line instead of sleeping makes
    setup as fast as the machine allows and fails loudly when a helper crashes.
    """
    assert proc.stdout is not None, "read_line needs stdout=subprocess.PIPE"
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{proc.args!r} printed no line within {timeout:.1f}s")
            if not sel.select(left):
                continue
            chunk = os.read(fd, 1)  # byte by byte: never consume output past the line we return
            if not chunk:
                stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"{proc.args!r} exited ({proc.wait()}) before printing: {stderr[-2000:]}")
            buf += chunk
    return buf.decode().rstrip("\n")


def stop(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds, and reap the leader.

    Processes not started in their own session (e.g. a foreground command) are signalled alone.
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        _signal(proc, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _signal(proc, signal.SIGKILL)  # leftover children of an exited group leader
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        if getattr(proc, "lab_own_group", False):
            os.killpg(proc.pid, sig)
        elif proc.returncode is None:
            proc.send_signal(sig)  # shares our process group: never signal the whole group
    except (ProcessLookupError, PermissionError):
        pass
