"""A hivemind DHT node whose background process, and its p2pd, die with the process that owns it.

hivemind runs the DHT in a forked child that starts a Go p2pd daemon. If the owner is killed with
SIGKILL, neither notices and both live on as orphans holding ports. Here the child arms the Linux
parent-death signal and, on SIGTERM, kills its own children (p2pd) before exiting.

p2pd also dials from its listening port by default (libp2p's TCP port reuse). With a fixed port that
breaks a node restarted on the same port behind NAT: the bootstrap node is still dialling the old
node there, its SYNs are dropped by the NAT until ours to it leaves from that same port, and the two
SYNs meet as one TCP simultaneous open. Both ends then think they dialled, the security handshake
fails ("noise: message is too short") and p2pd exits with "failed to connect to bootstrap peers".
Our nodes therefore dial from ephemeral ports; nothing here uses port reuse (no hole punching).

The parent-death signal follows the thread that forked, not the process: a node started from a worker
thread (``asyncio.to_thread``) would die when that thread ends, and every later call would hang. So a
node starts only from the main thread.
"""

from __future__ import annotations

import os
import signal
import threading
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

    def start(self) -> None:  # forks the DHT process
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "start the DHT node from the main thread: its process would die with the thread that forks it"
            )
        super().start()

    def run(self) -> None:  # runs in the forked DHT process
        arm_parent_death_signal(self._owner_pid)
        signal.signal(signal.SIGTERM, _terminate_children_and_exit)
        os.environ["LIBP2P_TCP_REUSEPORT"] = "false"  # read by the p2pd this process starts (see above)
        super().run()
