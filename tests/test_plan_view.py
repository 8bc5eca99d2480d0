"""plan_view: the one derivation of a peer's stage, neighbours, replicas and dial directions."""

from __future__ import annotations

import pytest

from coordinator.membership import make_plan
from swarm.dht.plan_view import PlanViewError, plan_view, stage_of


def ep(port: int) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}"


def plan(reachable: dict[str, bool] | None = None):
    return make_plan(
        reachable=reachable,
        swarm="s",
        run_id="r",
        version=3,
        model_name="gpt-tiny",
        coordinator=ep(9000),
        stages=[
            (0, 2, [("a", ep(9001))]),
            (2, 4, [("b", ep(9002)), ("c", ep(9003))]),
            (4, 6, [("d", ep(9004))]),
        ],
    )


def test_a_replica_sees_both_neighbours_and_every_holder_of_its_block() -> None:
    v = plan_view(plan(), "c")
    assert (v.stage, v.num_stages, v.layers) == (1, 3, (2, 4))
    assert v.upstreams == {"a": ep(9001)}
    assert v.downstreams == {"d": ep(9004)}
    assert v.replicas == {"b": ep(9002), "c": ep(9003)}
    assert v.replicated and not v.is_first and not v.is_last
    assert v.to_dial() == [("downstream", "d", ep(9004))]


def test_ends_of_the_pipeline() -> None:
    first, last = plan_view(plan(), "a"), plan_view(plan(), "d")
    assert first.is_first and not first.upstreams and set(first.downstreams) == {"b", "c"}
    assert last.is_last and not last.downstreams and not last.replicated
    assert last.to_dial() == []


def test_a_peer_behind_nat_dials_both_sides_and_its_upstream_waits_for_it() -> None:
    p = plan(reachable={"d": False})
    behind = plan_view(p, "d")
    assert behind.dial_upstream and not behind.accept_downstream
    assert behind.to_dial() == [("upstream", "b", ep(9002)), ("upstream", "c", ep(9003))]
    above = plan_view(p, "b")
    assert above.accept_downstream and above.to_dial() == []


def test_a_peer_the_plan_does_not_name_gets_a_clear_error() -> None:
    assert stage_of(plan(), "zz") is None
    with pytest.raises(PlanViewError, match="gives peer zz no block"):
        plan_view(plan(), "zz")
