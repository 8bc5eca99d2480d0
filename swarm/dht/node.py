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

Every DHT child answers its owner through hivemind's ``MPFuture``, whose writes to the owner's one pipe
are serialised by a lock shared by all processes the owner forked. A child killed while it holds that
lock leaves it held for good, and every later node of that owner then waits for it before it can say
"ready": a peer's restart as a NAT client, or the next test in one pytest process, hung forever on
this. So a child's SIGTERM exits between its event loop's callbacks, never mid-write; the owner waits
for "ready" with a deadline, and a lock found stuck after it is replaced, so that the next start works.

The child inherits the owner's uncollected garbage, and its collector would run the owner's finalisers
there: a gRPC aio channel left in a reference cycle shuts gRPC's aio layer down when finalised, which
waits in a loop for a poller thread that exists only in the owner, so the child spun in its collector
and never said "ready" (CI, twice in a row, 60 s each). The owner therefore freezes its collector's
objects across the fork (``gc.freeze``): the child never collects what it inherited, and copies fewer
of the owner's pages on write.

A child that lives but never says "ready" is asked for its stacks (faulthandler, SIGUSR1) before it is
killed, and the owner's own are taken beside them (they found the collector hang above), and
``start_dht`` starts one fresh process after such a hang.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

import hivemind
from hivemind.utils.mpfuture import MPFuture

import swarm
from swarm.lifecycle import arm_parent_death_signal

READY_TIMEOUT_S = 60.0  # p2pd's own start deadline is 15 s; bootstrapping on a loaded machine takes more
LOCK_PROBE_S = 2.0  # a healthy child holds the update lock for one pipe write
SIGTERM_GRACE_S = 5.0
DEATH_POLL_S = 0.5  # how often a start checks that its process still lives
NO_REPORT = "its process did not report (killed)"
EXIT_GRACE_S = 2.0  # for the last message of a process that exited to arrive
STACKS_WAIT_S = 2.0  # for a silent process to write its stacks
HANG_ATTEMPTS = 2  # start_dht: a hung start is tried once more in a fresh process

log = logging.getLogger(__name__)


class DHTStartError(RuntimeError):
    """The DHT process did not become ready in time (it was killed)."""


class DHTHangError(DHTStartError):
    """The DHT process lived but never reported ready; ``stacks`` holds its threads' and its owner's."""

    def __init__(self, message: str, stacks: str) -> None:
        super().__init__(message)
        self.stacks = stacks


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


def _kill_children_and_exit() -> None:
    for child in _children(os.getpid()):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)


def _exit_between_callbacks(signum: int, frame: object) -> None:
    """SIGTERM in the DHT process: exit once the running callback returns, never inside one.

    hivemind writes a result to the owner's pipe under the shared lock within one callback of this
    process's event loop, so between callbacks the lock is never ours. A process whose loop is stuck
    is killed after a grace period all the same.
    """
    backstop = threading.Timer(SIGTERM_GRACE_S, _kill_children_and_exit)
    backstop.daemon = True
    backstop.start()
    try:
        asyncio.get_running_loop().call_soon(_kill_children_and_exit)
    except RuntimeError:  # the loop is not running yet, or no longer: nothing of hivemind's is mid-write
        _kill_children_and_exit()


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _kill_tree(pid: int) -> None:
    for child in _children(pid):
        _kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class OwnedDHT(hivemind.DHT):
    """``hivemind.DHT`` that never outlives its owner."""

    def __init__(self, *args: object, ready_timeout: float = READY_TIMEOUT_S, **kwargs: object) -> None:
        self._owner_pid = os.getpid()
        self._ready_timeout = ready_timeout
        self._stacks_file = tempfile.TemporaryFile()  # the child writes its stacks here when asked (SIGUSR1)
        super().__init__(*args, **kwargs)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the process; with ``await_ready``, wait for it at most ``timeout`` (or the node's
        ``ready_timeout``) seconds, else kill it and raise ``DHTStartError``. A process that dies first
        is reported when it dies, with how it died."""
        self.start()
        if not await_ready:
            return
        limit = self._ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            try:
                self.wait_until_ready(max(0.0, min(DEATH_POLL_S, deadline - time.monotonic())))
                return
            except TimeoutError:
                pass
            if self.exitcode is not None:
                try:  # what it sent before it exited (its start's own error) is still in the pipe
                    self.wait_until_ready(EXIT_GRACE_S)
                    return
                except TimeoutError:
                    self._give_up(f"the DHT process died with {_how(self.exitcode)} before it was ready", "")
            if time.monotonic() >= deadline:
                self._give_up(f"the DHT node did not become ready within {limit:.0f} s", NO_REPORT, hung=True)

    def _stacks(self, pid: int) -> str:
        """The silent child's threads (it dumps them on SIGUSR1) and this process's, as text."""
        where = _proc_state(pid)
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            return f"DHT process {pid}: gone"
        deadline, size = time.monotonic() + STACKS_WAIT_S, -1
        while time.monotonic() < deadline:  # until its dump stops growing
            now = os.fstat(self._stacks_file.fileno()).st_size
            if now and now == size:
                break
            size = now
            time.sleep(0.1)
        self._stacks_file.seek(0)
        child = self._stacks_file.read().decode(errors="replace")
        with tempfile.TemporaryFile() as own:
            faulthandler.dump_traceback(own, all_threads=True)
            own.seek(0)
            owner = own.read().decode(errors="replace")
        return f"DHT process {pid} ({where}):\n{child or '(wrote nothing)'}\nowner {os.getpid()}:\n{owner}"

    def _give_up(self, what: str, why: str, hung: bool = False) -> NoReturn:
        pid = self.pid
        stacks = self._stacks(pid) if hung and pid is not None else ""
        if pid is not None:
            _kill_tree(pid)
        self.join(5.0)
        stuck = not MPFuture._update_lock.acquire(timeout=LOCK_PROBE_S)
        if stuck:  # held by a dead child: no process of ours can report to us until it is replaced
            MPFuture.reset_backend()
        else:
            MPFuture._update_lock.release()
        reasons = [why] if why else []
        if stuck:
            reasons = ["hivemind's update lock was left held by a killed DHT process (replaced: a new start works)"]
        if not swarm.GRPC_FORK_SUPPORT_OFF:
            reasons.append(
                "gRPC's fork support is on, and a DHT process forked while gRPC is busy can crash:"
                " import swarm before grpc, or set GRPC_ENABLE_FORK_SUPPORT=false"
            )
        message = f"{what}: {'; '.join(reasons)}" if reasons else what
        if hung:
            log.error("%s; where each side was:\n%s", message, stacks)
            raise DHTHangError(message, stacks) from None
        raise DHTStartError(message) from None

    def start(self) -> None:  # forks the DHT process
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "start the DHT node from the main thread: its process would die with the thread that forks it"
            )
        frozen_before = gc.get_freeze_count()  # an owner that froze objects itself keeps them frozen
        gc.freeze()  # the child never collects what it inherits (see the module's docstring)
        try:
            super().start()
        finally:
            if not frozen_before:
                gc.unfreeze()  # the owner's own collector goes on as before

    def run(self) -> None:  # runs in the forked DHT process
        signal.signal(signal.SIGTERM, _exit_between_callbacks)
        faulthandler.register(signal.SIGUSR1, file=self._stacks_file, all_threads=True)
        arm_parent_death_signal(self._owner_pid)
        os.environ["LIBP2P_TCP_REUSEPORT"] = "false"  # read by the p2pd this process starts (see above)
        super().run()


def _proc_state(pid: int) -> str:
    """A process's scheduler state and kernel wait channel, e.g. "S, futex_wait_queue" for a lock wait."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
    except (OSError, IndexError):
        return "state unknown"
    return f"state {state}, waiting in {wchan}"


def start_dht(*, dht_class: type[OwnedDHT] = OwnedDHT, attempts: int = HANG_ATTEMPTS, **kwargs: object) -> OwnedDHT:
    """Start a DHT node; a start that hung (its process alive, silent) is retried in a fresh process.

    A fresh fork helps where the first one copied the owner mid-change (a lock another thread of the
    owner held at that moment); what the owner keeps holding, it inherits again. A start that failed in
    any other way (p2pd refused, the process died) is the caller's to handle, as before.
    """
    for attempt in range(1, attempts):
        try:
            return dht_class(start=True, **kwargs)
        except DHTHangError as e:
            log.warning("DHT start %d of %d hung (%s); starting a fresh process", attempt, attempts, e)
    return dht_class(start=True, **kwargs)
