"""A peer that must restart its DHT node as a client (behind NAT) retries a failed start with backoff.

The root cause of the failed restarts (p2pd dialling from its listening port) is reproduced with real
namespaces and NAT in tests/lab/test_nat_dht.py; here the retry itself, with a p2pd that fails to start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

import pytest
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

import peer.discovery as discovery
from coordinator.membership import Membership, MembershipSettings, make_plan
from peer.discovery import Discovery, DiscoveryError, DiscoverySettings
from swarm.dht.keys import export_public_key, generate_private_key
from swarm.dht.node import OwnedDHT

BOOTSTRAP = "/ip4/10.77.0.2/tcp/31401/p2p/QmXG7aYAdCBeZn36ywy8XKkxSUYF3fNT2jJSYTvFztRtTH"
P2PD_FAILURE = "Daemon failed to start: 2026/12/01 10:11:24 failed to connect to bootstrap peers"


class FlakyDHT:
    """Stands in for start_dht's node: the first ``failures`` starts fail the way p2pd does."""

    starts: list[bool] = []
    failures = 0

    def __init__(self, **kwargs: object) -> None:
        FlakyDHT.starts.append(bool(kwargs["client_mode"]))
        if len(FlakyDHT.starts) <= FlakyDHT.failures:
            raise P2PDaemonError(P2PD_FAILURE)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def disc(monkeypatch: pytest.MonkeyPatch) -> Discovery:
    FlakyDHT.starts, FlakyDHT.failures = [], 0
    monkeypatch.setattr(discovery, "start_dht", lambda **kwargs: FlakyDHT(**kwargs))
    monkeypatch.setattr(discovery, "RESTART_FIRST_DELAY_S", 0.01, raising=False)
    settings = DiscoverySettings(
        swarm="nat",
        initial_peers=(BOOTSTRAP,),
        coordinator_key=export_public_key(generate_private_key()),
        find_timeout=5,
    )
    d = Discovery(settings)
    d.dht = FlakyDHT(client_mode=False)  # the server-mode node that the dial-back showed unreachable
    FlakyDHT.starts = []
    return d


def test_a_failed_restart_as_a_client_is_retried_and_says_why(disc, caplog) -> None:
    FlakyDHT.failures = 2
    with caplog.at_level(logging.WARNING, logger="peer.discovery"):
        asyncio.run(disc.restart_as_client())
    assert FlakyDHT.starts == [True, True, True]
    assert isinstance(disc.dht, FlakyDHT)
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 2, caplog.text
    assert "attempt 1" in retries[0] and "failed to connect to bootstrap peers" in retries[0], retries[0]
    assert BOOTSTRAP in retries[0], retries[0]


def test_a_restart_that_keeps_failing_gives_up_at_the_find_timeout_with_the_reason(disc) -> None:
    FlakyDHT.failures = 10**6
    disc.s = dataclasses.replace(disc.s, find_timeout=0.5)
    with pytest.raises(DiscoveryError, match="failed to connect to bootstrap peers") as err:
        asyncio.run(disc.restart_as_client())
    assert "as a client" in str(err.value) and "attempts" in str(err.value)
    assert 2 <= len(FlakyDHT.starts) < 100  # retried, with a growing delay, not in a busy loop
    assert disc.dht is None


def test_a_real_peer_restarted_as_a_client_on_its_fixed_port_still_reads_the_signed_plan(tmp_path) -> None:
    membership = Membership(MembershipSettings(swarm="restart", key_file=tmp_path / "c.pem", heartbeat=1.0))
    membership.start()
    with socket.socket() as s:  # a fixed DHT port, as `ravn-peer join --dht-port` gives
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    real = Discovery(
        DiscoverySettings(
            swarm="restart",
            initial_peers=tuple(membership.maddrs()),
            coordinator_key=membership.public_key,
            find_timeout=10,
            dht_port=port,
        )
    )
    try:
        real.start()
        peers = [("a", "/ip4/127.0.0.1/tcp/1001")]
        plan = make_plan(
            swarm="restart", run_id="r", version=2, model_name="gpt-tiny", coordinator="/ip4/127.0.0.1/tcp/31337",
            stages=[(0, 3, peers)],
        )  # fmt: skip
        assert asyncio.run(membership.publish(plan))
        assert asyncio.run(real.find_swarm()).version == 2
        asyncio.run(real.restart_as_client())
        assert real.dht.client_mode
        assert asyncio.run(real.find_swarm()).version == 2
    finally:
        real.shutdown()
        membership.shutdown()


def test_a_dht_node_refuses_to_start_from_a_worker_thread() -> None:
    """Its process would get the parent-death signal when the thread ends (Linux ties it to the thread)."""
    with pytest.raises(RuntimeError, match="main thread"):
        asyncio.run(asyncio.to_thread(OwnedDHT, start=True))
