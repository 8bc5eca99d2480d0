"""An owned DHT node never hangs its owner: a start that does not report is cut off at a deadline, a
lock left held by a killed DHT process is replaced, and a SIGTERM never lands mid-write."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest
from hivemind.utils.mpfuture import MPFuture

from swarm.dht import node as dht_node
from swarm.dht.node import DHTStartError, OwnedDHT

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]


def test_a_lock_left_held_by_a_killed_dht_process_fails_one_start_clearly_and_not_the_next() -> None:
    held = MPFuture._update_lock
    assert held.acquire(timeout=5)  # what a DHT process killed mid-write leaves behind
    try:
        started = time.monotonic()
        with pytest.raises(DHTStartError, match="update lock was left held"):
            OwnedDHT(start=True, host_maddrs=LOCALHOST, ready_timeout=5)
        assert time.monotonic() - started < 30
        assert MPFuture._update_lock is not held
        node = OwnedDHT(start=True, host_maddrs=LOCALHOST, ready_timeout=60)
        try:
            assert node.get_visible_maddrs()
        finally:
            node.shutdown()
    finally:
        held.release()


def _hold_the_lock_and_get_sigterm(lock: object) -> None:
    """A DHT process's loop: one callback holds the shared lock while SIGTERM arrives."""
    signal.signal(signal.SIGTERM, dht_node._exit_between_callbacks)

    def write_under_the_lock() -> None:
        with lock:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here, mid-write

    loop = asyncio.new_event_loop()
    loop.call_soon(write_under_the_lock)
    loop.call_later(30, loop.stop)
    loop.run_forever()
    os._exit(3)  # not reached: SIGTERM exits the process once the callback returns


def test_sigterm_in_a_dht_process_never_leaves_the_shared_lock_held() -> None:
    lock = mp.get_context("fork").Lock()
    child = mp.get_context("fork").Process(target=_hold_the_lock_and_get_sigterm, args=(lock,))
    child.start()
    child.join(20)
    assert child.exitcode == 0
    assert lock.acquire(timeout=1), "the process died holding the lock"
    lock.release()
