"""A hivemind DHT node whose background process, and its p2pd, die with the process that owns it.

hivemind runs the DHT in a forked child that starts a Go p2pd daemon. If the owner is killed with
SIGKILL, neither notices and both live on as orphans holding ports. Here the child arms the Linux
parent-death signal and, on SIGTERM, kills its own children (p2pd) before exiting.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import hivemind

from swarm.lifecycle import arm_parent_death_signal


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _terminate_children_and_exit(signum: int, frame: object) -> None:
    for child in _children(os.getpid()):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)


class OwnedDHT(hivemind.DHT):
    """``hivemind.DHT`` that never outlives its owner."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._owner_pid = os.getpid()
        super().__init__(*args, **kwargs)

    def run(self) -> None:  # runs in the forked DHT process
        arm_parent_death_signal(self._owner_pid)
        signal.signal(signal.SIGTERM, _terminate_children_and_exit)
        super().run()
