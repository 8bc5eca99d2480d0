"""Per-link codecs in the signed plan: what a peer sends with, and plans or assignments it must refuse."""

from __future__ import annotations

import pytest
import torch
from hivemind.utils.crypto import RSAPublicKey
from pydantic import ValidationError

from coordinator.membership import make_plan
from peer.plan_trust import AssignmentError, PlanTrust
from swarm.config import TrainConfig
from swarm.dht.plan_view import PlanViewError, plan_view, wire_codecs
from swarm.messages import train_from_pb, train_to_pb
from swarm.pb import wire_pb2 as pb
from swarm.wire.codec_policy import WirePolicy
from swarm.wire.packets import WireError
from tests.sealed_plans import COORDINATOR_KEY, SWARM, assignment


def ep(port: int) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}"


STAGES = [(0, 2, [("a", ep(9001))]), (2, 4, [("b", ep(9002)), ("c", ep(9003))]), (4, 6, [("d", ep(9004))])]


def link(boundary: int, up: str, down: str, forward: str = "bf16", backward: str = "bf16") -> dict:
    return {"boundary": boundary, "upstream": up, "downstream": down, "forward": forward, "backward": backward}


LINKS = [
    link(0, "a", "b", "int4_rot", "bf16"),
    link(0, "a", "c", "int4_rot", "int8"),
    link(1, "b", "d", "bf16", "int8"),
    link(1, "c", "d", "int8", "bf16"),
]


def plan(links: list[dict] | None = None):
    return make_plan(
        swarm=SWARM, run_id="r", version=3, model_name="gpt-tiny", coordinator=ep(9000), stages=STAGES, links=links
    )


def test_each_peer_sends_with_its_own_links_codecs() -> None:
    p = plan(LINKS)
    a, c, d = (wire_codecs(plan_view(p, x), "auto", "auto") for x in "acd")
    assert (a.forward, a.backward_to) == ("int4_rot", {})
    assert (c.forward, c.backward_to) == ("int8", {"a": "int8"})
    assert d.backward_to == {"b": "int8", "c": "bf16"}
    # the links win over explicit run codecs too (the coordinator writes the run's codecs on every link then)
    assert wire_codecs(plan_view(p, "b"), "fp32", "fp32").backward_to == {"a": "bf16"}


def test_a_plan_without_links_keeps_the_run_codecs_and_refuses_auto() -> None:
    p = plan()
    b = wire_codecs(plan_view(p, "b"), "int4_rot", "int8")
    assert (b.forward, b.backward, b.backward_to) == ("int4_rot", "int8", {})
    with pytest.raises(PlanViewError, match=r"link b -> d no forward codec.*--wire-forward auto"):
        wire_codecs(plan_view(p, "b"), "auto", "int8")
    with pytest.raises(PlanViewError, match=r"link a -> b no backward codec.*--wire-backward auto"):
        wire_codecs(plan_view(p, "b"), "int4_rot", "auto")
    assert wire_codecs(plan_view(p, "a"), "fp32", "auto").backward_to == {}  # the first stage sends no gradients


@pytest.mark.parametrize(
    ("links", "why"),
    [
        ([*LINKS[:3], link(1, "c", "d", "int3")], "Input should be 'fp32'"),  # an unknown codec
        (LINKS[:3], r"the link c -> d \(stage 1 -> 2\) no codec"),  # a link without one
        ([*LINKS, link(0, "a", "d")], "a -> d across boundary 0 that is not between neighbours"),
        ([*LINKS, LINKS[0]], "names a link twice"),
        ([link(0, "a", "b", "int4_rot"), link(0, "a", "c", "int8"), *LINKS[2:]], "gives a two forward codecs"),
    ],
)
def test_a_plan_with_bad_links_is_refused(links: list[dict], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        plan(links)


def trust(peer: str) -> PlanTrust:
    return PlanTrust(RSAPublicKey.from_bytes(COORDINATOR_KEY.get_public_key().to_bytes()), SWARM, peer)


def test_an_auto_assignment_whose_plan_names_no_link_is_refused_before_acting() -> None:
    auto = train_to_pb(TrainConfig(wire_forward="auto", wire_backward="auto"))
    t = trust("b")
    with pytest.raises(AssignmentError, match="no forward codec"):
        t.accept(assignment(STAGES, run_id="r", version=2, train=auto))
    assert t.newest == 0  # nothing was acted on
    view = t.accept(assignment(STAGES, run_id="r", version=2, train=auto, plan_kw={"links": LINKS}))
    assert view.sends_forward == "bf16" and view.sends_backward == {"a": "bf16"}
    bad = train_to_pb(TrainConfig(wire_forward="auto"))
    bad.wire_forward = pb.INT8  # both auto and a codec: contradictory
    with pytest.raises(WireError, match="both --wire-forward auto and a codec"):
        train_from_pb(bad)


def test_the_policy_encodes_each_gradient_with_its_destinations_codec() -> None:
    policy = WirePolicy(forward="int4_rot", backward="int8", backward_to={"a": "bf16", "b": "int8"})
    grad = torch.randn(2, 8, 64)
    mb = pb.MicroBatch(id=7)
    assert policy.gradients(mb, grad, to="a").gradients.grad.codec == pb.BF16
    assert policy.gradients(mb, grad, to="b").gradients.grad.codec == pb.INT8
    assert policy.gradients(mb, grad, to="z").gradients.grad.codec == pb.INT8  # unnamed: the run's codec
    assert policy.activations(mb, grad, None).activations.hidden.codec == pb.INT4_ROT
    assert policy.sent == {"backward:bf16": 1, "backward:int8": 2, "forward:int4_rot": 1}


def test_the_policy_keeps_one_residual_per_destination_at_its_codec() -> None:
    policy = WirePolicy(forward="fp32", backward="int8", error_feedback="on", backward_to={"a": "bf16", "b": "int8"})
    grad = torch.randn(4, 64)
    for i in range(3):
        policy.gradients(pb.MicroBatch(id=i), grad, to="a")
        policy.gradients(pb.MicroBatch(id=i), grad, to="b")
    assert set(policy._feedback) == {"b"}  # bf16 is not lossy in the policy's sense: no residual for "a"
