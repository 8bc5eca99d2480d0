"""Peers obey only plans signed by the key in their join command, and only assignments those plans back."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.utils import get_dht_time

from coordinator.membership import Membership, MembershipSettings, make_plan
from peer.discovery import Discovery, DiscoveryError, DiscoverySettings
from swarm.config import PROTOCOL_VERSION
from swarm.dht.keys import generate_private_key, plan_subkey
from swarm.dht.node import OwnedDHT
from swarm.dht.records import dht_record_validators, publish_plan, seal_plan
from swarm.dht.schema import plan_key

SWARM = "trust"
COORD = "/ip4/127.0.0.1/tcp/31337"


def plan(version: int, peers: list[tuple[str, str]], protocol: int = PROTOCOL_VERSION) -> dict:
    body = make_plan(
        swarm=SWARM,
        run_id="r",
        version=version,
        model_name="gpt-tiny",
        coordinator=COORD,
        stages=[(0, 2, [peers[0]]), (2, 3, [peers[1]])],
    ).model_dump()
    body["protocol_version"] = protocol
    return body


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    membership = Membership(
        MembershipSettings(swarm=SWARM, key_file=tmp_path_factory.mktemp("k") / "c.pem", heartbeat=1.0)
    )
    membership.start()
    forger_key = generate_private_key()
    forger = OwnedDHT(
        start=True, initial_peers=membership.maddrs(), record_validators=dht_record_validators(forger_key)
    )
    disc = Discovery(
        DiscoverySettings(
            swarm=SWARM,
            initial_peers=tuple(membership.maddrs()),
            coordinator_key=membership.public_key,
            heartbeat=0.5,
            find_timeout=5,
        )
    )
    disc.start()
    try:
        yield membership, forger, forger_key, disc
    finally:
        disc.shutdown()
        forger.shutdown()
        membership.shutdown()


def test_forged_and_unsigned_plans_are_ignored(swarm) -> None:
    membership, forger, forger_key, disc = swarm
    genuine = [("a", "/ip4/127.0.0.1/tcp/1001"), ("b", "/ip4/127.0.0.1/tcp/1002")]
    assert asyncio.run(
        membership.publish(
            make_plan(
                swarm=SWARM,
                run_id="r",
                version=3,
                model_name="gpt-tiny",
                coordinator=COORD,
                stages=[(0, 2, [genuine[0]]), (2, 3, [genuine[1]])],
            )
        )
    )
    evil = [("mallory", "/ip4/127.0.0.1/tcp/6666"), ("b", "/ip4/127.0.0.1/tcp/1002")]
    # A plan signed with another key, with a higher version, in the same swarm:
    assert publish_plan(forger, SWARM, plan(99, evil), forger_key, ttl=30)
    # An unsigned copy of a plan stored under the coordinator's own subkey is refused by the DHT itself:
    envelope = seal_plan(
        make_plan(swarm=SWARM, run_id="r", version=100, model_name="x", coordinator=COORD, stages=[(0, 3, [evil[0]])]),
        forger_key,
    )
    stored = forger.store(plan_key(SWARM), envelope, get_dht_time() + 30, subkey=plan_subkey(membership.key))
    assert not stored
    got = asyncio.run(disc.fetch())
    assert got is not None and got.version == 3
    assert [p.peer_id for st in got.stages for p in st.peers] == ["a", "b"]


def test_a_plan_of_another_protocol_is_refused_naming_both_versions(swarm) -> None:
    membership, *_ = swarm
    other = DiscoverySettings(
        swarm="trust-skew",
        initial_peers=tuple(membership.maddrs()),
        coordinator_key=membership.public_key,
        heartbeat=0.5,
        find_timeout=10,
    )
    body = plan(1, [("a", "/ip4/127.0.0.1/tcp/1"), ("b", "/ip4/127.0.0.1/tcp/2")], protocol=PROTOCOL_VERSION + 7)
    body["swarm"] = "trust-skew"
    assert publish_plan(membership.dht, "trust-skew", body, membership.key, ttl=30)
    disc = Discovery(other)
    disc.dht = membership.dht
    with pytest.raises(DiscoveryError, match=f"protocol version {PROTOCOL_VERSION + 7}.*speaks {PROTOCOL_VERSION}"):
        asyncio.run(disc.find_swarm())
