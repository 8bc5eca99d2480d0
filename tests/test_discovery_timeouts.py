"""A peer's DHT round that times out is a missed heartbeat, not the end of its announcements.

``announce_peer`` and ``fetch_plan`` raise TimeoutError when the DHT does not answer within their
timeout (a stalled DHT process, a loaded gaming PC). The heartbeat runs as a background task for the
peer's whole life: one timeout ended it, the peer's record expired for good and the swarm lost a live
peer that it could never plan again. (The coordinator's side: tests/test_dht_timeouts.py.)
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import peer.discovery as discovery
from peer.discovery import Discovery, DiscoverySettings
from swarm.dht.keys import export_public_key, generate_private_key


def make_discovery(heartbeat: float = 0.02) -> Discovery:
    key = export_public_key(generate_private_key())
    return Discovery(DiscoverySettings(swarm="s", initial_peers=(), coordinator_key=key, heartbeat=heartbeat))


def test_the_heartbeat_outlives_an_announcement_that_timed_out(monkeypatch) -> None:
    calls = []

    def announce(dht, swarm, record, ttl, signing_key=None) -> bool:
        calls.append(record)
        if len(calls) == 1:
            raise TimeoutError("DHT store under 'ravn/s/peers' took over 10s")
        return True

    monkeypatch.setattr(discovery, "announce_peer", announce)
    disc = make_discovery()
    disc.record = SimpleNamespace(peer_id="p0")

    async def beat() -> None:
        task = asyncio.create_task(disc.heartbeat())
        try:
            for _ in range(250):
                if len(calls) >= 3 or task.done():
                    break
                await asyncio.sleep(0.02)
            assert not task.done(), task.exception()
        finally:
            task.cancel()

    asyncio.run(beat())
    assert len(calls) >= 3


def test_a_plan_lookup_that_timed_out_finds_nothing_yet(monkeypatch) -> None:
    def fetch(dht, swarm, key, min_version=0):
        raise TimeoutError("DHT lookup of 'ravn/s/plan' took over 10s")

    monkeypatch.setattr(discovery, "fetch_plan", fetch)
    assert asyncio.run(make_discovery().fetch()) is None


def test_no_announcement_starts_once_the_peer_leaves(monkeypatch) -> None:
    """An announcement after the tombstone would carry a later expiry and bring a leaving peer back."""
    events = []

    def announce(dht, swarm, record, ttl, signing_key=None) -> bool:
        events.append("announce")
        return True

    def withdraw(dht, swarm, record, ttl, signing_key=None) -> bool:
        events.append("withdraw")
        time.sleep(0.2)  # ten heartbeats while the tombstone is stored
        return True

    monkeypatch.setattr(discovery, "announce_peer", announce)
    monkeypatch.setattr(discovery, "withdraw_peer", withdraw)
    disc = make_discovery()
    disc.dht = object()
    disc.record = SimpleNamespace(peer_id="p0")

    async def leave_while_beating() -> None:
        task = asyncio.create_task(disc.heartbeat())
        try:
            await asyncio.sleep(0.1)
            await disc.leave()
            await asyncio.sleep(0.1)
        finally:
            task.cancel()

    asyncio.run(leave_while_beating())
    assert "announce" in events and "announce" not in events[events.index("withdraw") :], events
