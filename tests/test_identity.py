"""The identity check a peer's Stage service applies to Link and Average (``peer.stage_service.impostor``)."""

from __future__ import annotations

from types import SimpleNamespace

from peer.stage_service import impostor
from swarm.dht.schema import Plan
from swarm.dht.signing import new_key
from swarm.security import auth
from swarm.security.identity import CallSigner, plan_keys
from tests.test_dht_records import make_plan

TOKEN = auth.generate_token()
UPSTREAM, STRANGER = CallSigner(new_key()), CallSigner(new_key())


def context(peer: str, signer: CallSigner) -> SimpleNamespace:
    md = auth.proof_metadata(auth.SwarmKey.from_token(TOKEN), peer, "peer-b", "/ravn.wire.Stage/Link", signer=signer)
    return SimpleNamespace(invocation_metadata=lambda: md)


def test_only_the_holder_of_the_planned_key_passes_as_that_neighbour() -> None:
    plan = {**make_plan("s"), "swarm": "s"}
    plan["stages"][0]["peers"][0]["public_key"] = UPSTREAM.public_key
    keys = plan_keys(Plan.model_validate(plan))
    assert keys == {"peer-a": UPSTREAM.public_key}  # peer-b's record had no key: none is pinned for it
    daemon = SimpleNamespace(swarm_token=TOKEN, peer_key=keys.get)  # the StageHost fields it reads
    assert impostor(daemon, context("peer-a", UPSTREAM), "peer-a") is None
    assert "not signed by that peer's key" in impostor(daemon, context("peer-a", STRANGER), "peer-a")
    assert "made by 'peer-x' but names peer 'peer-a'" in impostor(daemon, context("peer-x", STRANGER), "peer-a")
    assert "not in the current plan" in impostor(daemon, context("peer-b", STRANGER), "peer-b")
    open_swarm = SimpleNamespace(swarm_token="", peer_key=keys.get)
    assert impostor(open_swarm, context("peer-x", STRANGER), "peer-a") is None  # no token: nobody is authenticated
