"""A DHT store stalled by one unresponsive node must not let a healthy peer's record expire.

hivemind stores a value at every replica and waits for all of them: a replica that holds its connections
open but answers nothing (a frozen gaming PC, a NAT that drops packets) makes each store last the DHT's
RPC wait (3 s by default), though the live replicas took the record at once. The heartbeat slept one
heartbeat *after* each announcement, so a stall of more than two heartbeats let the record (which lives
three) expire between announcements, and the coordinator counted a live peer as gone. Here a real DHT of
three nodes, one of them frozen with SIGSTOP (its process and its p2pd), and the peer's real heartbeat:
the record must stay readable at the coordinator's node the whole time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import suppress
from pathlib import Path

from peer.discovery import Discovery, DiscoverySettings
from swarm.config import PROTOCOL_VERSION
from swarm.dht.keys import export_public_key, generate_private_key
from swarm.dht.node import OwnedDHT
from swarm.dht.records import announce_peer, dht_record_validators, peers_key
from tests.test_dht_records import LOCALHOST, make_record

HEARTBEAT_S = 2.0  # `ravn local`'s: the record lives 6 s; a stalled store lands 3 s late and returns after 6
WATCH_S = 12.0


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the DHT process's p2pd), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def record_alive(node: OwnedDHT, swarm: str, peer_id: str) -> bool:
    """Whether ``node`` holds ``peer_id``'s unexpired record (its own copy: no lookup waits on the frozen node)."""
    future = node.get(peers_key(swarm), latest=False, return_future=True)
    try:  # a local hit takes milliseconds; without one the lookup waits on the frozen node (3 s)
        found = future.result(timeout=2.0)
    except TimeoutError:
        future.cancel()
        return False
    if found is None or not isinstance(found.value, dict) or peer_id not in found.value:
        return False
    return found.value[peer_id].expiration_time > time.time()


def test_a_store_stalled_by_a_frozen_replica_does_not_expire_a_live_peers_record() -> None:
    swarm = "stall"
    kwargs = dict(host_maddrs=LOCALHOST, record_validators=dht_record_validators(), start=True)
    coordinator = OwnedDHT(**kwargs)
    frozen: OwnedDHT | None = None
    disc: Discovery | None = None
    stopped: list[int] = []
    try:
        maddrs = [str(m) for m in coordinator.get_visible_maddrs()]
        frozen = OwnedDHT(initial_peers=maddrs, **kwargs)
        key = export_public_key(generate_private_key())
        disc = Discovery(
            DiscoverySettings(swarm=swarm, initial_peers=tuple(maddrs), coordinator_key=key, heartbeat=HEARTBEAT_S)
        )
        disc.start()
        record = make_record("alice", protocol_version=PROTOCOL_VERSION)
        assert announce_peer(disc.dht, swarm, record, 3 * HEARTBEAT_S)  # the peer's node now knows all three
        stopped = [frozen.pid, *children(frozen.pid)]
        assert len(stopped) >= 2, "no p2pd found under the DHT process"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)

        start = time.monotonic()
        announce_peer(disc.dht, swarm, record, 3 * HEARTBEAT_S)
        stall = time.monotonic() - start
        assert stall > 2 * HEARTBEAT_S, f"a store took only {stall:.1f} s: the frozen node did not stall it"

        async def watch() -> list[float]:
            disc.record = record
            first = asyncio.create_task(disc.announce(record))  # as when the peer joined
            await asyncio.sleep(0.5)  # the live replicas take it at once; the frozen one stalls the call
            beating = asyncio.create_task(disc.heartbeat())
            missing = []
            try:
                deadline = time.monotonic() + WATCH_S
                while time.monotonic() < deadline:
                    assert not beating.done(), beating.exception()
                    if not await asyncio.to_thread(record_alive, coordinator, swarm, "alice"):
                        missing.append(round(WATCH_S - (deadline - time.monotonic()), 1))
                    await asyncio.sleep(0.1)
            finally:
                beating.cancel()
                with suppress(asyncio.CancelledError):
                    await beating
                await first
            return missing

        missing = asyncio.run(watch())
        assert missing == [], f"stores took {stall:.1f} s; the record was gone at {missing} s into the watch"
    finally:
        for pid in stopped:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if disc is not None:
            disc.shutdown()
        if frozen is not None:
            frozen.shutdown()
        coordinator.shutdown()
