"""Discovery records: schemas and multiaddrs (unit tests), then reads/writes on a real 3-node hivemind DHT.

The DHT has three nodes, started once for the module (each is a ~280 MB process):
  * ``coordinator`` signs plans with the coordinator key (the swarm's bootstrap node),
  * ``peer`` is an honest peer that pinned the coordinator's public key,
  * ``attacker`` runs a validator that signs with its own key but *accepts anything* into its own
    storage, so forged records really sit in the DHT and honest readers must reject them.
Every test uses its own swarm name, so tests do not see each other's records.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time
from pydantic import ValidationError

from swarm.dht.keys import (
    export_public_key,
    generate_private_key,
    load_or_create_private_key,
    load_private_key,
    load_public_key,
    plan_subkey,
    public_key_fingerprint,
    save_private_key,
)
from swarm.dht.multiaddrs import (
    EndpointError,
    canonical_endpoint,
    grpc_target_to_multiaddr,
    multiaddr_to_grpc_target,
    parse_endpoint,
)
from swarm.dht.node import OwnedDHT
from swarm.dht.records import (
    PlanVerificationError,
    announce_peer,
    dht_record_validators,
    fetch_plan,
    list_peers,
    publish_plan,
    seal_plan,
    verify_plan,
    withdraw_peer,
)
from swarm.dht.schema import (
    PeerRecord,
    Plan,
    ProtocolMismatchError,
    check_protocol,
    peers_key,
    plan_key,
    validate_swarm_name,
)

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]
TTL = 60.0


def make_record(peer_id: str = "peer-a", **overrides: object) -> PeerRecord:
    fields: dict[str, object] = dict(
        peer_id=peer_id,
        endpoint="/ip4/127.0.0.1/tcp/31337",
        device="cuda:0 NVIDIA GeForce RTX 3090",
        free_memory_bytes=20 * 2**30,
        throughput_layers_per_s=42.5,
        bandwidth_up_bytes_per_s=5e6,
        bandwidth_down_bytes_per_s=5e7,
        block={"layer_start": 0, "layer_end": 4},
        state="online",
        software_version="0.1.0",
        protocol_version=1,
        reachable=None,
        timestamp=1.7e9,
    )
    fields.update(overrides)
    return PeerRecord.model_validate(fields)


def make_plan(swarm: str, version: int = 1, **overrides: object) -> dict:
    plan: dict[str, object] = dict(
        run_id="run-1",
        version=version,
        model_name="gpt-small",
        coordinator="/ip4/127.0.0.1/tcp/31337",
        protocol_version=1,
        stages=[
            {"layer_start": 0, "layer_end": 3, "peers": [{"peer_id": "peer-a", "endpoint": "/ip4/10.0.0.1/tcp/1"}]},
            {"layer_start": 3, "layer_end": 6, "peers": [{"peer_id": "peer-b", "endpoint": "/dns/b.example/tcp/2"}]},
        ],
        issued_at=1.7e9,
    )
    plan.update(overrides)
    return plan


def wait_until(condition: Callable[[], bool], deadline_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``deadline_s`` seconds."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {deadline_s}s waiting until {what}")
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------
# Multiaddrs (unit)


@pytest.mark.parametrize(
    ("maddr", "target"),
    [
        ("/ip4/203.0.113.7/tcp/31337", "203.0.113.7:31337"),
        ("/ip6/0:0:0:0:0:0:0:1/tcp/80", "[::1]:80"),
        ("/dns/peer.example.org/tcp/443", "peer.example.org:443"),
        ("/dns4/peer.example.org/tcp/443", "peer.example.org:443"),
    ],
)
def test_multiaddr_to_grpc_target_and_back(maddr: str, target: str) -> None:
    assert multiaddr_to_grpc_target(maddr) == target
    back = grpc_target_to_multiaddr(target)
    assert multiaddr_to_grpc_target(back) == target
    assert back == canonical_endpoint(back)


def test_canonical_endpoint_normalises_ipv6() -> None:
    assert canonical_endpoint("/ip6/0:0:0:0:0:0:0:1/tcp/80") == "/ip6/::1/tcp/80"
    assert parse_endpoint("/ip4/1.2.3.4/tcp/5").port == 5


@pytest.mark.parametrize(
    ("maddr", "message"),
    [
        ("203.0.113.7:31337", "is not a multiaddr"),
        ("/ip4/300.1.1.1/tcp/1", "not a valid multiaddr"),
        ("/ip4/1.2.3.4/tcp/70000", "not a valid multiaddr"),
        ("/ip4/1.2.3.4/udp/5", "shape /ip4/udp"),
        ("/ip4/1.2.3.4", "shape /ip4;"),
        ("/ip4/1.2.3.4/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "shape /ip4/tcp/p2p"),
        ("/tcp/1/ip4/1.2.3.4", "shape /tcp/ip4"),
        ("/ip4/1.2.3.4/tcp/0", "port 0"),
        ("/ip4/0.0.0.0/tcp/5", "unspecified address"),
        ("/ip6/::/tcp/5", "unspecified address"),
        ("/ip4/224.0.0.1/tcp/5", "multicast address"),
        ("/dns/a b/tcp/1", "not a valid multiaddr"),
        ("/dns/ünï.example/tcp/5", "non-ASCII"),
        ("/ip4/" + "1" * 300, "characters long"),
    ],
)
def test_bad_multiaddrs_are_rejected_with_clear_messages(maddr: str, message: str) -> None:
    with pytest.raises(EndpointError, match=message) as info:
        parse_endpoint(maddr)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("::1:5", "must be bracketed"),
        ("[1.2.3.4]:5", "only IPv6"),
        ("[::1]5", "not '\\[address\\]:port'"),
        ("host:port", "non-numeric port"),
        (":5", "not 'host:port'"),
        ("0.0.0.0:5", "unspecified"),
        ("", "non-empty"),
    ],
)
def test_bad_grpc_targets_are_rejected(target: str, message: str) -> None:
    with pytest.raises(EndpointError, match=message):
        grpc_target_to_multiaddr(target)


# ---------------------------------------------------------------------------------------------------
# Schemas and keys (unit)


def test_swarm_names_are_validated_and_namespace_the_keys() -> None:
    assert peers_key("alpha-1") == "ravn/alpha-1/peers"
    assert plan_key("alpha_1") == "ravn/alpha_1/plan"
    for bad in ["", "Alpha", "a/b", "-a", "a" * 33, "a b", "ünï"]:
        with pytest.raises(ValueError, match="invalid swarm name"):
            validate_swarm_name(bad)


def test_peer_record_roundtrips_as_a_plain_dict() -> None:
    record = make_record()
    value = record.to_dht_value()
    assert value["block"] == {"layer_start": 0, "layer_end": 4}
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps(value)) == value  # msgpack, not pickle
    assert PeerRecord.model_validate(value) == record
    assert make_record(block=None, reachable=True).block is None


@pytest.mark.parametrize(
    "override",
    [
        {"free_memory_bytes": "20000"},  # strict: no str -> int
        {"free_memory_bytes": 1.0},  # strict: no float -> int
        {"free_memory_bytes": -1},
        {"free_memory_bytes": 2**60},
        {"protocol_version": True},
        {"throughput_layers_per_s": float("nan")},
        {"bandwidth_up_bytes_per_s": float("inf")},
        {"state": "zombie"},
        {"reachable": "yes"},
        {"peer_id": "x" * 200},
        {"peer_id": "[owner:ssh-rsa AAAA]"},
        {"device": "gpu\n\x1b[31mred"},
        {"software_version": "1.0 beta"},
        {"block": {"layer_start": 4, "layer_end": 4}},
        {"block": {"layer_start": 0, "layer_end": 4, "extra": 1}},
        {"endpoint": "/ip4/1.2.3.4/udp/5"},
        {"timestamp": "now"},
        {"unknown_field": 1},
    ],
)
def test_peer_record_rejects_bad_fields(override: dict) -> None:
    with pytest.raises(ValidationError):
        make_record(**override)


def test_peer_record_endpoint_error_names_the_address() -> None:
    with pytest.raises(ValidationError, match="0.0.0.0"):
        make_record(endpoint="/ip4/0.0.0.0/tcp/5")


def test_plan_must_be_a_contiguous_pipeline() -> None:
    Plan.model_validate({"swarm": "s", **make_plan("s")})
    gap = make_plan("s")
    gap["stages"][1]["layer_start"] = 4
    with pytest.raises(ValidationError, match="stage 1 starts at layer 4, expected 3"):
        Plan.model_validate({"swarm": "s", **gap})
    dup = make_plan("s")
    dup["stages"][0]["peers"] *= 2
    with pytest.raises(ValidationError, match="lists a peer twice"):
        Plan.model_validate({"swarm": "s", **dup})
    with pytest.raises(ValidationError):
        Plan.model_validate({"swarm": "s", **make_plan("s", stages=[])})


def test_check_protocol_names_both_versions() -> None:
    check_protocol(make_record(protocol_version=3), 3)
    with pytest.raises(ProtocolMismatchError, match="protocol version 2, we speak protocol version 3"):
        check_protocol(make_record(protocol_version=2, software_version="0.0.9"), 3)


def test_public_key_export_is_one_token_and_loads_back() -> None:
    key = generate_private_key()
    text = export_public_key(key)
    assert " " not in text and text.startswith("AAAA")
    loaded = load_public_key(text)
    assert plan_subkey(loaded) == plan_subkey(key)
    assert public_key_fingerprint(loaded).startswith("SHA256:")
    assert plan_subkey(load_public_key(f"ssh-rsa {text} coordinator@host")) == plan_subkey(key)
    for bad, message in [("", "empty"), ("not-base64!", "does not parse"), ("a b c", "neither")]:
        with pytest.raises(ValueError, match=message):
            load_public_key(bad)


def test_private_key_is_saved_with_owner_only_permissions(tmp_path) -> None:
    key = generate_private_key()
    path = save_private_key(key, tmp_path / "coordinator.pem")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert plan_subkey(load_private_key(path)) == plan_subkey(key)
    with pytest.raises(FileExistsError):
        save_private_key(generate_private_key(), path)
    other = generate_private_key()
    save_private_key(other, path, overwrite=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert plan_subkey(load_or_create_private_key(path)) == plan_subkey(other)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_private_key(path)
    created = load_or_create_private_key(tmp_path / "new.pem")
    assert plan_subkey(load_private_key(tmp_path / "new.pem")) == plan_subkey(created)


def test_verify_plan_rejects_tampering_other_keys_and_other_swarms() -> None:
    key, other = generate_private_key(), generate_private_key()
    plan = Plan.model_validate({"swarm": "s", **make_plan("s")})
    envelope = seal_plan(plan, key)
    assert verify_plan(envelope, "s", key.get_public_key()) == plan
    tampered = {**envelope, "body": envelope["body"].replace('"version":1', '"version":2')}
    assert tampered["body"] != envelope["body"]
    with pytest.raises(PlanVerificationError, match="does not verify"):
        verify_plan(tampered, "s", key.get_public_key())
    with pytest.raises(PlanVerificationError, match="does not verify"):
        verify_plan(seal_plan(plan, other), "s", key.get_public_key())
    with pytest.raises(PlanVerificationError, match="not 's2'"):
        verify_plan(envelope, "s2", key.get_public_key())
    for junk in [None, "plan", {"body": envelope["body"]}, {**envelope, "v": 2}, {**envelope, "sig": 7}]:
        with pytest.raises(PlanVerificationError):
            verify_plan(junk, "s", key.get_public_key())


# ---------------------------------------------------------------------------------------------------
# A real DHT


class _LyingValidator(RSASignatureValidator):
    """An attacker's node: signs what it owns, but stores anything (never rejects a record)."""

    def validate(self, record: DHTRecord) -> bool:
        return True


async def _plant_raw(_dht: hivemind.DHT, node, *, key: str, subkey: bytes, value: bytes, expiration: float) -> bool:
    """Runs inside the attacker's DHT process: put raw bytes straight into its local storage."""
    return node.protocol.storage.store(DHTID.generate(source=key), value, expiration, subkey=subkey)


async def _local_subkeys(_dht: hivemind.DHT, node, *, key: str) -> list:
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return [] if found is None else [subkey for subkey, _ in found.value.items()]


@dataclass
class Nodes:
    coordinator: hivemind.DHT
    peer: hivemind.DHT
    attacker: hivemind.DHT


@pytest.fixture(scope="module")
def coordinator_key():
    return generate_private_key()


@pytest.fixture(scope="module")
def attacker_key():
    return generate_private_key()


@pytest.fixture(scope="module")
def nodes(coordinator_key, attacker_key) -> Iterator[Nodes]:
    started: list[OwnedDHT] = []
    try:
        coordinator = OwnedDHT(
            start=True, host_maddrs=LOCALHOST, record_validators=dht_record_validators(coordinator_key)
        )
        started.append(coordinator)
        bootstrap = coordinator.get_visible_maddrs()
        peer = OwnedDHT(
            initial_peers=bootstrap, start=True, host_maddrs=LOCALHOST, record_validators=dht_record_validators()
        )
        started.append(peer)
        attacker = OwnedDHT(
            initial_peers=bootstrap,
            start=True,
            host_maddrs=LOCALHOST,
            record_validators=[_LyingValidator(attacker_key)],
        )
        started.append(attacker)
        yield Nodes(coordinator, peer, attacker)
    finally:
        for dht in reversed(started):
            dht.shutdown()


def test_announce_on_one_node_list_on_another(nodes: Nodes) -> None:
    peer_id = nodes.peer.peer_id.to_base58()
    record = make_record(peer_id, endpoint="/ip4/127.0.0.1/tcp/4000")
    before = get_dht_time()
    assert announce_peer(nodes.peer, "announce", record, TTL)
    assert announce_peer(nodes.coordinator, "announce", make_record("peer-c", block=None), TTL)
    by_id = {r.peer_id: r for r in list_peers(nodes.coordinator, "announce")}
    assert set(by_id) == {peer_id, "peer-c"}
    seen_c, seen_p = by_id["peer-c"], by_id[peer_id]
    assert seen_c.peer_id == "peer-c" and seen_c.block is None
    assert seen_p.model_dump(exclude={"timestamp"}) == record.model_dump(exclude={"timestamp"})
    assert seen_p.timestamp >= before  # stamped at announce time
    assert [r.peer_id for r in list_peers(nodes.peer, "announce")] == sorted([peer_id, "peer-c"])
    check_protocol(seen_p, 1)
    with pytest.raises(ValueError, match="withdraw_peer"):
        announce_peer(nodes.peer, "announce", make_record(state="leaving"), TTL)


def test_records_expire_after_ttl(nodes: Nodes) -> None:
    assert announce_peer(nodes.peer, "expiry", make_record("short-lived"), ttl=3.0)
    assert announce_peer(nodes.peer, "expiry", make_record("long-lived"), ttl=TTL)
    assert [r.peer_id for r in list_peers(nodes.coordinator, "expiry")] == ["long-lived", "short-lived"]
    wait_until(
        lambda: [r.peer_id for r in list_peers(nodes.coordinator, "expiry")] == ["long-lived"],
        deadline_s=15,
        what="the short-lived record expires",
    )


def test_graceful_withdraw_disappears_at_once_and_rejoin_works(nodes: Nodes) -> None:
    record = make_record("leaver")
    assert announce_peer(nodes.peer, "withdraw", record, TTL)
    assert announce_peer(nodes.peer, "withdraw", make_record("stayer"), TTL)
    assert [r.peer_id for r in list_peers(nodes.coordinator, "withdraw")] == ["leaver", "stayer"]
    assert withdraw_peer(nodes.peer, "withdraw", record, TTL)
    assert [r.peer_id for r in list_peers(nodes.coordinator, "withdraw")] == ["stayer"]  # no waiting
    states = {r.peer_id: r.state for r in list_peers(nodes.coordinator, "withdraw", include_leaving=True)}
    assert states == {"leaver": "leaving", "stayer": "online"}
    assert announce_peer(nodes.peer, "withdraw", record, TTL)
    assert [r.peer_id for r in list_peers(nodes.coordinator, "withdraw")] == ["leaver", "stayer"]


def test_two_swarms_on_one_dht_do_not_mix(nodes: Nodes) -> None:
    assert announce_peer(nodes.peer, "swarm-a", make_record("only-in-a"), TTL)
    assert announce_peer(nodes.coordinator, "swarm-b", make_record("only-in-b"), TTL)
    assert [r.peer_id for r in list_peers(nodes.attacker, "swarm-a")] == ["only-in-a"]
    assert [r.peer_id for r in list_peers(nodes.attacker, "swarm-b")] == ["only-in-b"]
    assert list_peers(nodes.attacker, "swarm-c") == []


def test_malformed_records_are_skipped_and_logged(nodes: Nodes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="swarm.dht.records")
    key, expiration = peers_key("malformed"), get_dht_time() + TTL
    assert announce_peer(nodes.peer, "malformed", make_record("good"), TTL)
    bad_types = {**make_record("bad-types").to_dht_value(), "free_memory_bytes": "lots"}
    assert nodes.attacker.store(key, bad_types, expiration, subkey="bad-types")
    assert nodes.attacker.store(key, "not a dict", expiration, subkey="not-a-dict")
    assert nodes.attacker.store(key, make_record("victim").to_dht_value(), expiration, subkey="impostor")
    assert [r.peer_id for r in list_peers(nodes.coordinator, "malformed")] == ["good"]
    logged = caplog.text
    assert "'bad-types'" in logged and "free_memory_bytes" in logged
    assert "'not-a-dict'" in logged
    assert "victim stored under another subkey 'impostor'" in logged


def test_signed_plan_is_accepted(nodes: Nodes, coordinator_key) -> None:
    assert publish_plan(nodes.coordinator, "plan-ok", make_plan("plan-ok", version=3), coordinator_key, TTL)
    pinned = export_public_key(coordinator_key)  # what the join command carries
    plan = fetch_plan(nodes.peer, "plan-ok", pinned)
    assert plan is not None
    assert (plan["swarm"], plan["run_id"], plan["version"]) == ("plan-ok", "run-1", 3)
    assert plan["stages"][1]["peers"] == [
        {
            "peer_id": "peer-b",
            "endpoint": "/dns/b.example/tcp/2",
            "reachable": True,
            "tls_fingerprint": "",
            "public_key": "",  # no key in the record: nobody may call in peer-b's name
        }
    ]
    assert fetch_plan(nodes.peer, "plan-ok", pinned, min_version=4) is None  # no rollback
    assert fetch_plan(nodes.peer, "other-swarm", pinned) is None


def test_publishing_needs_a_dht_that_signs_with_that_key(nodes: Nodes, attacker_key) -> None:
    with pytest.raises(ValueError, match="dht_record_validators"):
        publish_plan(nodes.peer, "plan-no-signer", make_plan("plan-no-signer"), attacker_key, TTL)


def test_plan_signed_with_another_key_is_ignored(
    nodes: Nodes, coordinator_key, attacker_key, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="swarm.dht.records")
    pinned = coordinator_key.get_public_key()
    assert publish_plan(nodes.attacker, "plan-other-key", make_plan("plan-other-key", 99), attacker_key, TTL)
    assert fetch_plan(nodes.peer, "plan-other-key", pinned) is None
    assert public_key_fingerprint(attacker_key) in caplog.text
    assert publish_plan(nodes.coordinator, "plan-other-key", make_plan("plan-other-key", 1), coordinator_key, TTL)
    assert fetch_plan(nodes.peer, "plan-other-key", pinned)["version"] == 1


def test_unsigned_plan_under_the_coordinator_subkey_is_rejected(nodes: Nodes, coordinator_key) -> None:
    swarm, pinned = "plan-unsigned", coordinator_key.get_public_key()
    forged = Plan.model_validate({"swarm": swarm, **make_plan(swarm, 99)})
    # A valid-looking envelope, but the attacker cannot produce the DHT-level signature.
    envelope = {"v": 1, "body": forged.model_dump_json(), "sig": "AAAA"}
    nodes.attacker.store(plan_key(swarm), envelope, get_dht_time() + TTL, subkey=plan_subkey(pinned))
    stored_at_attacker = nodes.attacker.run_coroutine(partial(_local_subkeys, key=plan_key(swarm)))
    assert stored_at_attacker == [plan_subkey(pinned)]  # the forgery really is in the DHT
    assert fetch_plan(nodes.peer, swarm, pinned) is None
    assert publish_plan(nodes.coordinator, swarm, make_plan(swarm, 1), coordinator_key, TTL)
    assert fetch_plan(nodes.peer, swarm, pinned)["version"] == 1


def _signed_dht_value(key, swarm: str, envelope: dict, expiration: float) -> bytes:
    """The bytes the coordinator's node would store: msgpack(envelope) + DHT-level signature."""
    record = DHTRecord(
        key=DHTID.generate(source=plan_key(swarm)).to_bytes(),
        subkey=MSGPackSerializer.dumps(plan_subkey(key)),
        value=MSGPackSerializer.dumps(envelope),
        expiration_time=expiration,
    )
    return RSASignatureValidator(key).sign_value(record)


def test_tampered_plan_is_rejected(nodes: Nodes, coordinator_key) -> None:
    swarm, pinned = "plan-tampered", coordinator_key.get_public_key()
    expiration = get_dht_time() + TTL
    genuine = seal_plan(Plan.model_validate({"swarm": swarm, **make_plan(swarm, 1)}), coordinator_key)
    signed = _signed_dht_value(coordinator_key, swarm, genuine, expiration)
    signature = signed[len(MSGPackSerializer.dumps(genuine)) :]
    assert signature.startswith(b"[signature:")
    # Change the plan, keep both the envelope signature and the DHT signature of the original.
    tampered = {**genuine, "body": genuine["body"].replace('"version":1', '"version":99')}
    plant = partial(_plant_raw, key=plan_key(swarm), subkey=plan_subkey(pinned), expiration=expiration)
    assert nodes.attacker.run_coroutine(partial(plant, value=MSGPackSerializer.dumps(tampered) + signature))
    assert fetch_plan(nodes.peer, swarm, pinned) is None


def test_bad_envelope_is_rejected_even_with_a_valid_dht_signature(
    nodes: Nodes, coordinator_key, caplog: pytest.LogCaptureFixture
) -> None:
    # Defence in depth: fetch_plan checks the envelope itself, whatever the DHT layer let through.
    caplog.set_level(logging.WARNING, logger="swarm.dht.records")
    swarm, pinned = "plan-envelope", coordinator_key.get_public_key()
    expiration = get_dht_time() + TTL
    genuine = seal_plan(Plan.model_validate({"swarm": swarm, **make_plan(swarm, 1)}), coordinator_key)
    tampered = {**genuine, "body": genuine["body"].replace('"version":1', '"version":99')}
    value = _signed_dht_value(coordinator_key, swarm, tampered, expiration)
    assert nodes.attacker.run_coroutine(
        partial(_plant_raw, key=plan_key(swarm), subkey=plan_subkey(pinned), value=value, expiration=expiration)
    )
    assert fetch_plan(nodes.peer, swarm, pinned) is None
    assert "does not verify with the pinned coordinator key" in caplog.text
