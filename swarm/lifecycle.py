"""Tie a child process's life to its launcher, so a crashed ``ravn local`` leaves no orphans.

The child arms the Linux parent-death signal itself (no ``preexec_fn``: forking a process that runs
gRPC threads is unsafe), then checks that the launcher did not die before it was armed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

DIE_WITH_PARENT_ENV = "RAVN_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def arm_parent_death_signal(expected_parent: int) -> None:
    """Get SIGTERM when the parent goes away (Linux); at once if it already went."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != expected_parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent_if_asked() -> None:
    """If the launcher set RAVN_DIE_WITH_PARENT=<its pid>, get SIGTERM when it goes away."""
    expected = os.environ.pop(DIE_WITH_PARENT_ENV, "")
    if expected.isdigit():
        arm_parent_death_signal(int(expected))
