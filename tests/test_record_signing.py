"""Signed peer records: unit checks of the signature and the key pins, then a coordinator's membership on
a real hivemind DHT that ignores unsigned and forged records."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.membership import Membership, MembershipSettings
from swarm.config import PROTOCOL_VERSION
from swarm.dht.node import OwnedDHT
from swarm.dht.records import announce_peer, dht_record_validators, withdraw_peer
from swarm.dht.signing import KeyPins, RecordSignatureError, new_key, sign_record, verify_record
from tests.test_dht_records import LOCALHOST, make_record


def test_a_signed_record_verifies_and_any_change_breaks_it() -> None:
    key = new_key()
    signed = sign_record(make_record(), key)
    verify_record(signed)
    verify_record(type(signed).model_validate(signed.to_dht_value()))  # survives the DHT's plain dict
    for change in ({"endpoint": "/ip4/10.0.0.1/tcp/1"}, {"state": "leaving"}, {"timestamp": 1.8e9}):
        with pytest.raises(RecordSignatureError, match="invalid signature"):
            verify_record(signed.model_copy(update=change))
    other = sign_record(make_record(), new_key())
    with pytest.raises(RecordSignatureError, match="invalid signature"):  # someone else's key, this signature
        verify_record(signed.model_copy(update={"public_key": other.public_key}))
    with pytest.raises(RecordSignatureError, match="not signed"):
        verify_record(make_record())


def test_pins_keep_a_live_peers_name_and_free_it_once_its_record_expired() -> None:
    now = [0.0]
    pins = KeyPins(ttl=15.0, clock=lambda: now[0])
    honest, forger = new_key(), new_key()
    pins.check(sign_record(make_record(), honest))
    now[0] = 10.0
    with pytest.raises(RecordSignatureError, match="another key"):
        pins.check(sign_record(make_record(), forger))
    pins.check(sign_record(make_record(), honest))  # refreshes the pin
    now[0] = 24.0
    with pytest.raises(RecordSignatureError, match="another key"):
        pins.check(sign_record(make_record(), forger))
    now[0] = 40.0  # the honest peer stopped announcing 30 s ago: a restarted peer (new key) may take the name
    pins.check(sign_record(make_record(), forger))


def test_membership_on_a_real_dht_ignores_unsigned_and_forged_records(tmp_path: Path) -> None:
    swarm = "signed"
    membership = Membership(MembershipSettings(swarm=swarm, key_file=tmp_path / "coordinator.pem", heartbeat=5.0))
    membership.start()
    node = None
    try:
        node = OwnedDHT(
            initial_peers=membership.maddrs(),
            start=True,
            host_maddrs=LOCALHOST,
            record_validators=dht_record_validators(),
        )
        honest = new_key()
        record = make_record("alice", protocol_version=PROTOCOL_VERSION, endpoint="/ip4/127.0.0.1/tcp/4000")
        assert announce_peer(node, swarm, record, 60.0, signing_key=honest)
        assert announce_peer(node, swarm, make_record("mallory", protocol_version=PROTOCOL_VERSION), 60.0)  # unsigned

        def listed() -> dict:
            return {r.peer_id: r for r in asyncio.run(membership.peers(include_leaving=True))}

        seen = listed()
        assert set(seen) == {"alice"} and seen["alice"].endpoint == "/ip4/127.0.0.1/tcp/4000"
        # a stranger stores a record in alice's name (its own valid signature, another endpoint), then a tombstone
        forger = new_key()
        forged = record.model_copy(update={"endpoint": "/ip4/10.6.6.6/tcp/4000"})
        assert announce_peer(node, swarm, forged, 90.0, signing_key=forger)
        assert set(listed()) == set()  # the DHT holds only the forged value now: ignored, alice absent
        assert withdraw_peer(node, swarm, forged, 120.0, signing_key=forger)
        assert set(listed()) == set()  # a forged "leaving" is ignored too
        assert withdraw_peer(node, swarm, record, 150.0, signing_key=honest)  # alice herself leaves: seen
        seen = listed()
        assert seen["alice"].state == "leaving" and seen["alice"].endpoint == "/ip4/127.0.0.1/tcp/4000"
    finally:
        if node is not None:
            node.shutdown()
        membership.shutdown()
