"""A real peer daemon serving one fixed assignment, without a coordinator or DHT.

Run as ``python -m tests.lone_peer TOKEN UPSTREAM_KEY``: it holds the last stage of a 2-stage gpt-tiny (upstream
neighbour "upstream"), serves its Stage.Link with the same auth and limit interceptors as ``ravn-peer``
(the daemon's own ``start_server``), prints ``serving <host:port>`` and runs until terminated. Tests use
it to send hostile input to a separate OS process and read that process's memory from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from peer.daemon import PeerDaemon
from swarm.dht.multiaddrs import multiaddr_to_grpc_target
from tests.sealed_plans import peer_settings
from tests.test_fuzz import assignment  # the same fixed assignment the fuzz target serves


async def main(token: str, upstream_key: str) -> None:
    daemon = PeerDaemon(peer_settings("last", device="cpu", swarm_token=token))
    endpoint = await daemon.start_server()
    await daemon.session._on_assign(assignment(upstream_key))  # its sealed plan pins the upstream's key
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"serving {multiaddr_to_grpc_target(endpoint)}", flush=True)
    try:
        await stop.wait()
    finally:
        await daemon.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(sys.argv[1], sys.argv[2]))
