"""Processes for tests/lab/test_nat_dht.py, each run inside a lab namespace.

``bootstrap ADDR PORT``: a DHT node that prints its multiaddr, then stores and reads every half second,
as a coordinator polling its swarm does (so it keeps dialling nodes it has seen, gone or not).
``restart ADDR PORT BOOTSTRAP CYCLES``: starts a DHT node on one fixed port, stores through it, stops it
and starts a client-mode node on the same port, CYCLES times; one JSON line per start says whether the
new node reached the bootstrap node.
"""

from __future__ import annotations

import json
import sys
import time

from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.timed_storage import get_dht_time

from swarm.dht.node import OwnedDHT

HOLD_S = 2.0  # long enough for the bootstrap node to store on (and so dial) the node it has just met


def bootstrap(addr: str, port: int) -> None:
    dht = OwnedDHT(start=True, host_maddrs=[f"/ip4/{addr}/tcp/{port}"])
    print("MADDR", dht.get_visible_maddrs()[0], flush=True)
    i = 0
    while True:
        dht.store(f"poll-{i % 4}", i, get_dht_time() + 10)
        dht.get("restart", latest=True)
        i += 1
        time.sleep(0.5)


def _start(addr: str, port: int, initial: str, client_mode: bool) -> tuple[OwnedDHT | None, str]:
    try:
        node = OwnedDHT(
            start=True, initial_peers=[initial], host_maddrs=[f"/ip4/{addr}/tcp/{port}"], client_mode=client_mode
        )
    except P2PDaemonError as e:
        return None, str(e).splitlines()[0]
    return node, ""


def restart(addr: str, port: int, initial: str, cycles: int) -> None:
    for cycle in range(cycles):
        for client_mode in (False, True):
            node, error = _start(addr, port, initial, client_mode)
            print(json.dumps({"cycle": cycle, "client_mode": client_mode, "error": error}), flush=True)
            if node is None:
                continue
            if not client_mode:
                node.store("restart", cycle, get_dht_time() + 30)
                time.sleep(HOLD_S)
            node.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "bootstrap":
        bootstrap(sys.argv[2], int(sys.argv[3]))
    else:
        restart(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
