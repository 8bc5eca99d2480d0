"""A recovery whose new plan leaves out a peer that still has a session must not crash the coordinator.

Seen on a loaded machine (a 0.5 B checkpoint on 2 cores): every peer's DHT record expired within a minute,
one came back as a joiner while another's stayed expired, and the coordinator re-planned without the
latter, then asked the plan for that peer's assignment and died with a traceback ("the signed plan v6
gives peer peer-2 no block"). A peer that the new plan leaves out is gone from this plan: its session is
ended, it is named in the recovery message, and the peers in the plan get their assignments.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

from coordinator.run_settings import RunSettings
from coordinator.sessions import PeerSession
from coordinator.swarm_run import SwarmRun
from swarm.config import MODEL_PRESETS, PROTOCOL_VERSION, TrainConfig
from swarm.dht.keys import generate_private_key
from swarm.dht.schema import PeerRecord

KEY = generate_private_key()


def record(peer_id: str) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        endpoint=f"/ip4/127.0.0.1/tcp/{1000 + int(peer_id[1:])}",
        device="cpu",
        free_memory_bytes=int(8e9),
        throughput_layers_per_s=10.0,
        bandwidth_up_bytes_per_s=50e6,
        bandwidth_down_bytes_per_s=50e6,
        state="online",
        software_version="0.1.0",
        protocol_version=PROTOCOL_VERSION,
        timestamp=time.time(),
    )


class Membership:
    """The DHT as the coordinator sees it: the records listed; plans are stored and nothing else."""

    def __init__(self, records: list[PeerRecord]) -> None:
        self.records = records
        self.s = SimpleNamespace(heartbeat=0.02, swarm="test")
        self.key = KEY
        self.ttl = 0.06
        self.published = []

    async def peers(self, include_leaving: bool = False) -> list[PeerRecord]:
        return [r for r in self.records if include_leaving or r.state != "leaving"]

    async def publish(self, plan) -> bool:
        self.published.append(plan)
        return True


def test_a_session_peer_that_the_new_plan_leaves_out_is_dropped_not_a_crash(tmp_path: Path) -> None:
    membership = Membership([record("p0"), record("p1"), record("p2")])
    settings = RunSettings(
        name="left-out",
        run_dir=tmp_path,
        model=MODEL_PRESETS["gpt-tiny"],
        train=TrainConfig(checkpoint_every=1),
        peers=3,
    )
    run = SwarmRun(settings, membership)
    messages: list[str] = []
    run.progress.message = messages.append
    run.planning.control_endpoint = "/ip4/127.0.0.1/tcp/9"
    asyncio.run(run.roster.publish(run.planning.plan_for(membership.records)))
    for peer_id, (a, b, endpoint) in run.planning.planned.items():
        run.sessions.peers[peer_id] = PeerSession(peer_id, endpoint, "cpu", 0, stage=a // (b - a))
    run.flow.started = True
    run.sessions.lost.add("p0")  # p0's control stream broke
    membership.records = [record("p1")]  # and p2's record expired while the re-plan read the DHT

    version = asyncio.run(run.recovery.recover("peer p0 is gone"))

    assert version == 0
    assert set(run.planning.planned) == {"p1"}
    assert set(run.sessions.peers) == {"p1"}, "a peer the plan leaves out keeps no session"
    assert any("p2" in m and "recovered without" in m for m in messages), messages
    commands = []
    queue = run.sessions.peers["p1"].commands
    while not queue.empty():
        commands.append(queue.get_nowait())
    assert any(c is not None and c.HasField("assign") for c in commands)
