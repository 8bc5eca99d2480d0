"""The coordinator's view of the swarm, read from the DHT and nowhere else.

Peers announce themselves under ``ravn/<swarm>/peers`` with an expiry of a few heartbeats; the
coordinator publishes the plan under ``ravn/<swarm>/plan``, signed with its key. A peer that stops
heartbeating (crash, cable pulled) expires out of the swarm on its own, and a graceful leave writes a
'leaving' tombstone that hides it at once. DHT calls block, so they run on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.config import PROTOCOL_VERSION
from swarm.dht.keys import export_public_key, load_or_create_private_key, public_key_fingerprint
from swarm.dht.node import OwnedDHT, start_dht
from swarm.dht.records import dht_record_validators, list_peers, publish_plan
from swarm.dht.schema import PeerRecord, Plan, PlannedLayer, validate_swarm_name
from swarm.dht.signing import KeyPins, RecordSignatureError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MembershipSettings:
    swarm: str
    key_file: Path
    host: str = "127.0.0.1"
    dht_port: int = 0
    announce_host: str = ""
    heartbeat: float = 5.0
    initial_peers: tuple[str, ...] = ()
    require_signed_records: bool = True  # ignore peer records not signed by their peer's key
    identity_file: Path | None = None  # a fixed DHT identity: peers' initial-peer addresses survive a restart


class Membership:
    """Owns the coordinator's DHT node and signing key; lists peers and publishes plans."""

    def __init__(self, settings: MembershipSettings) -> None:
        validate_swarm_name(settings.swarm)
        self.s = settings
        settings.key_file.parent.mkdir(parents=True, exist_ok=True)
        self.key = load_or_create_private_key(settings.key_file)
        self.public_key = export_public_key(self.key)
        self.fingerprint = public_key_fingerprint(self.key)
        self.dht: OwnedDHT | None = None
        self.pins = KeyPins(ttl=3 * settings.heartbeat)
        self._ignored: set[str] = set()

    def start(self) -> list[str]:
        """Start the DHT node (before any gRPC server: it forks) and return its dialable multiaddrs."""
        ip = "ip6" if ":" in self.s.host else "ip4"
        kwargs = {}
        if self.s.announce_host:
            kwargs["announce_maddrs"] = [f"/{ip}/{self.s.announce_host}/tcp/{self.s.dht_port}"]
        if self.s.identity_file is not None:
            kwargs["identity_path"] = str(self.s.identity_file)
        self.dht = start_dht(
            host_maddrs=[f"/{ip}/{self.s.host}/tcp/{self.s.dht_port}"],
            initial_peers=list(self.s.initial_peers),
            record_validators=dht_record_validators(self.key),
            **kwargs,
        )
        return self.maddrs()

    def maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()] if self.dht else []

    @property
    def ttl(self) -> float:
        return 3 * self.s.heartbeat

    async def peers(self, *, include_leaving: bool = False) -> list[PeerRecord]:
        """Live peers of this swarm that speak our protocol; others are logged and ignored."""
        records = await asyncio.to_thread(list_peers, self.dht, self.s.swarm, include_leaving=include_leaving)
        good = []
        for r in records:
            if r.protocol_version != PROTOCOL_VERSION:
                log.warning(
                    "ignoring peer %s: it speaks protocol version %d, this coordinator speaks %d",
                    r.peer_id,
                    r.protocol_version,
                    PROTOCOL_VERSION,
                )
                continue
            if self.s.require_signed_records:
                try:
                    self.pins.check(r)
                except RecordSignatureError as e:
                    if str(e) not in self._ignored:  # once per reason: the DHT is polled every heartbeat
                        self._ignored.add(str(e))
                        log.warning("ignoring a peer record: %s", e)
                    continue
            good.append(r)
        return good

    async def publish(self, plan: Plan) -> bool:
        return await asyncio.to_thread(publish_plan, self.dht, self.s.swarm, plan, self.key, self.ttl)

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None


def make_plan(
    *,
    reachable: dict[str, bool] | None = None,
    fingerprints: dict[str, str] | None = None,
    public_keys: dict[str, str] | None = None,
    coordinator_tls_fingerprint: str = "",
    layer: PlannedLayer | None = None,
    swarm: str,
    run_id: str,
    version: int,
    model_name: str,
    coordinator: str,
    stages: list[tuple[int, int, list[tuple[str, str]]]],
    links: list[dict] | None = None,
) -> Plan:
    """A plan from (layer_start, layer_end, [(peer_id, endpoint), ...]) per stage; ``fingerprints``: the
    TLS certificate each peer's record announced, which its neighbours pin (signed with the plan);
    ``public_keys``: the key each peer's record is signed with (pinned at join), which signs its calls;
    ``coordinator_tls_fingerprint``: the Control service's certificate, which every peer pins ("" in clear);
    ``layer``: the layer peers measure their speed on; ``links``: each link's codecs (``schema.PlanLink``
    fields; none: every link sends the run's codecs)."""
    return Plan.model_validate(
        {
            "swarm": swarm,
            "run_id": run_id,
            "version": version,
            "model_name": model_name,
            "coordinator": coordinator,
            "coordinator_tls_fingerprint": coordinator_tls_fingerprint,
            "layer": layer.model_dump() if layer is not None else None,
            "protocol_version": PROTOCOL_VERSION,
            "issued_at": time.time(),
            "stages": [
                {
                    "layer_start": a,
                    "layer_end": b,
                    "peers": [
                        {
                            "peer_id": p,
                            "endpoint": e,
                            "reachable": (reachable or {}).get(p, True),
                            "tls_fingerprint": (fingerprints or {}).get(p, ""),
                            "public_key": (public_keys or {}).get(p, ""),
                        }
                        for p, e in peers
                    ],
                }
                for a, b, peers in stages
            ],
            "links": list(links or []),
        }
    )
