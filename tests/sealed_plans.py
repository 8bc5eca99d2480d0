"""Signed plans for tests that run a peer daemon without a coordinator: a peer obeys only assignments
whose plan its trusted coordinator key sealed, so these fake coordinators seal theirs like the real one."""

from __future__ import annotations

from coordinator.membership import make_plan
from peer.settings import PeerSettings
from swarm.dht.keys import export_public_key, generate_private_key
from swarm.dht.records import seal_plan
from swarm.pb import control_pb2 as cpb

SWARM = "test-swarm"
COORDINATOR = "/ip4/127.0.0.1/tcp/9"
COORDINATOR_KEY = generate_private_key()  # the fake coordinator's key, trusted by every peer built here

Stages = list[tuple[int, int, list[tuple[str, str]]]]


def peer_settings(peer_id: str, **kw) -> PeerSettings:
    """Settings of a peer that trusts :data:`COORDINATOR_KEY`."""
    return PeerSettings(peer_id=peer_id, coordinator_key=export_public_key(COORDINATOR_KEY), swarm=SWARM, **kw)


def sealed(stages: Stages, *, run_id: str = "run", version: int = 1, **kw) -> cpb.SignedPlan:
    """``stages`` as (layer_start, layer_end, [(peer, endpoint)]), sealed by :data:`COORDINATOR_KEY`;
    ``kw`` as :func:`coordinator.membership.make_plan` takes them (public_keys, reachable, ...)."""
    plan = make_plan(
        swarm=SWARM, run_id=run_id, version=version, model_name="gpt-tiny", coordinator=COORDINATOR, stages=stages, **kw
    )
    envelope = seal_plan(plan, COORDINATOR_KEY)
    return cpb.SignedPlan(body=envelope["body"], sig=envelope["sig"])


def assignment(stages: Stages, *, run_id: str = "run", version: int = 1, plan_kw: dict | None = None, **fields):
    """An Assignment for ``run_id`` carrying its sealed plan; ``fields``: model, train, epoch, restore_version."""
    return cpb.Assignment(
        run_id=run_id, plan=sealed(stages, run_id=run_id, version=version, **(plan_kw or {})), **fields
    )
