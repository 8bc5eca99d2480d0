"""The per-link codec rule (coordinator/wire_choice.py): LAN links send bf16, slow uplinks the smallest codec."""

from __future__ import annotations

import math

import pytest

from coordinator.cost_model import CostModel, ModelSpec, PeerSpec
from coordinator.placement import place
from coordinator.plan_inputs import CODEC_BYTES, GRADIENT_CODEC_BYTES, wire_bytes
from coordinator.wire_choice import FITS, LINK_BOUND, bottleneck_without, choose_links, pick_codec
from swarm.config import AUTO_BACKWARD_LADDER, AUTO_FORWARD_LADDER, backward_ladder, forward_ladder

ELEMENTS = 4 * 128 * 256  # one gpt-medium micro-batch: 4 sequences x 128 tokens x width 256
MBIT = 1e6 / 8  # bytes/s per Mbit/s
SPEED = 100.0  # layers/s: 10 ms of compute per one-layer stage


def peer(name: str, up_mbit: float = 1000.0, down_mbit: float = 1000.0, speed: float = SPEED) -> PeerSpec:
    return PeerSpec(name, speed=speed, free_memory=1e12, upload=up_mbit * MBIT, download=down_mbit * MBIT)


def no_links(n_layers: int = 3) -> ModelSpec:
    """Compute only, so a boundary's budget is the slowest stage's compute (10 ms here)."""
    return ModelSpec.uniform(n_layers, layer_memory=1.0, boundary_bytes=0.0)


def chain(*peers: PeerSpec) -> tuple[list[tuple[int, int, list[str]]], dict[str, PeerSpec]]:
    return [(i, i + 1, [p.peer_id]) for i, p in enumerate(peers)], {p.peer_id: p for p in peers}


def test_pick_codec_walks_the_ladder_least_lossy_first() -> None:
    budget = 0.010
    assert pick_codec(AUTO_FORWARD_LADDER, ELEMENTS, 1000 * MBIT, budget) == ("bf16", FITS)  # LAN: 2.1 ms
    assert pick_codec(AUTO_FORWARD_LADDER, ELEMENTS, 160 * MBIT, budget) == ("int8", FITS)  # bf16 13 ms, int8 6.8
    assert pick_codec(AUTO_FORWARD_LADDER, ELEMENTS, 80 * MBIT, budget) == ("int4_rot", FITS)  # int8 13.5, 7.2 ms
    assert pick_codec(AUTO_FORWARD_LADDER, ELEMENTS, 10 * MBIT, budget) == ("int4_rot", LINK_BOUND)
    assert pick_codec(("bf16", "int8"), ELEMENTS, 80 * MBIT, budget) == ("int8", LINK_BOUND)
    assert pick_codec(AUTO_BACKWARD_LADDER, ELEMENTS, 10 * MBIT, budget) == ("int4_rot", LINK_BOUND)
    # exactly on the budget still fits: the link is then as slow as the bottleneck, not slower
    exact = ELEMENTS * CODEC_BYTES["bf16"] / budget
    assert pick_codec(AUTO_FORWARD_LADDER, ELEMENTS, exact, budget) == ("bf16", FITS)


def test_pick_codec_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="empty codec ladder"):
        pick_codec((), ELEMENTS, 1.0, 1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        pick_codec(AUTO_FORWARD_LADDER, ELEMENTS, 0.0, 1.0)


def test_lan_link_sends_bf16_and_a_10_mbit_uplink_the_smallest() -> None:
    stages, peers = chain(peer("a"), peer("home", up_mbit=10.0), peer("c"))
    links = choose_links(stages, peers, no_links(), ELEMENTS, "auto", "auto")
    by = {(x.upstream, x.downstream): x for x in links}
    assert list(by) == [("a", "home"), ("home", "c")]
    lan, home = by["a", "home"], by["home", "c"]
    assert (lan.forward, lan.forward_reason, lan.forward_mbit_s) == ("bf16", FITS, 1000.0)
    # the gradient from "home" to "a" goes over home's 10 Mbit/s uplink
    assert (lan.backward, lan.backward_reason, lan.backward_mbit_s) == ("int4_rot", LINK_BOUND, 10.0)
    assert (home.forward, home.forward_reason, home.forward_mbit_s) == ("int4_rot", LINK_BOUND, 10.0)
    assert (home.backward, home.backward_reason) == ("bf16", FITS)  # c's uplink and home's downlink are fast


def test_middle_links_get_the_smallest_codec_that_fits() -> None:
    stages, peers = chain(peer("a", up_mbit=160.0), peer("b", up_mbit=80.0), peer("c"))
    by = {x.upstream: x for x in choose_links(stages, peers, no_links(), ELEMENTS, "auto", "auto")}
    assert (by["a"].forward, by["a"].forward_reason) == ("int8", FITS)
    assert (by["b"].forward, by["b"].forward_reason) == ("int4_rot", FITS)
    assert (by["a"].backward, by["a"].backward_reason) == ("int4_rot", FITS)  # b's 80 Mbit/s uplink: int8 14 ms


def test_a_slow_stage_elsewhere_lets_a_link_keep_bf16() -> None:
    """The budget is the bottleneck without the link: a stage 10x slower makes a 160 Mbit/s link fast enough."""
    fast = chain(peer("a", up_mbit=160.0), peer("b"), peer("c"))
    slow = chain(peer("a", up_mbit=160.0), peer("b"), peer("c", speed=SPEED / 10))
    assert choose_links(*fast, no_links(), ELEMENTS, "auto", "auto")[0].forward == "int8"
    assert choose_links(*slow, no_links(), ELEMENTS, "auto", "auto")[0].forward == "bf16"


def test_bottleneck_without_a_boundary_drops_only_its_bytes() -> None:
    spec = ModelSpec.uniform(2, layer_memory=1.0, boundary_bytes=1e6)  # 1 MB each way across the one boundary
    stages, peers = chain(peer("a", up_mbit=8.0), peer("b"))
    cm = CostModel(list(peers.values()), spec)
    assert cm.stage_time([0], 0, 1) > 1.0  # a's upload of 1 MB at 1 MB/s dominates as planned
    assert bottleneck_without(cm, stages, 0) == pytest.approx(1 / SPEED)


def test_a_sender_uses_one_forward_codec_for_all_downstream_holders() -> None:
    """Replicas downstream: activations are encoded before routing, so the slowest holder's link decides;
    each holder's gradients get their own codec."""
    peers = {p.peer_id: p for p in (peer("a"), peer("b1"), peer("b2", down_mbit=10.0, up_mbit=10.0), peer("c"))}
    stages = [(0, 1, ["a"]), (1, 2, ["b1", "b2"]), (2, 3, ["c"])]
    links = choose_links(stages, peers, no_links(), ELEMENTS, "auto", "auto")
    first = {x.downstream: x for x in links if x.boundary == 0}
    assert {x.forward for x in first.values()} == {"int4_rot"}
    assert {x.forward_mbit_s for x in first.values()} == {10.0}
    assert first["b1"].backward == "bf16" and first["b2"].backward == "int4_rot"
    second = {x.upstream: x for x in links if x.boundary == 1}
    assert second["b1"].forward == "bf16" and second["b2"].forward == "int4_rot"
    assert len(links) == 4


def test_explicit_codecs_go_on_every_link_unchanged() -> None:
    stages, peers = chain(peer("a", up_mbit=1.0), peer("b"), peer("c"))
    links = choose_links(stages, peers, no_links(), ELEMENTS, "int4_rot", "int8")
    assert [(x.forward, x.backward) for x in links] == [("int4_rot", "int8")] * 2
    assert {x.forward_reason for x in links} == {"set by --wire-forward"}
    mixed = choose_links(stages, peers, no_links(), ELEMENTS, "fp32", "auto")
    assert [x.forward for x in mixed] == ["fp32", "fp32"] and mixed[0].backward == "bf16"


def test_no_links_without_holders_and_none_without_measurements() -> None:
    assert choose_links([(0, 3, [])], {}, no_links(), ELEMENTS, "auto", "auto") == []
    assert choose_links([(0, 3, ["a"])], {"a": peer("a")}, no_links(), ELEMENTS, "auto", "auto") == []
    with pytest.raises(ValueError, match="no link measurement for planned peer"):
        choose_links([(0, 1, ["a"]), (1, 3, ["b"])], {"a": peer("a")}, no_links(), ELEMENTS, "auto", "auto")


def test_on_a_real_placement_every_adjacent_pair_gets_a_link() -> None:
    peers = [peer("a"), peer("b", up_mbit=10.0), peer("c"), peer("d")]
    spec = ModelSpec.uniform(6, layer_memory=1.0, boundary_bytes=ELEMENTS * CODEC_BYTES["int8"])
    placed = place(peers, spec, stages=3)
    stages = [(b.layer_start, b.layer_end, list(b.peer_ids)) for b in placed.blocks]
    links = choose_links(stages, {p.peer_id: p for p in peers}, spec, ELEMENTS, "auto", "auto")
    pairs = {(x.upstream, x.downstream) for x in links}
    expected = {(u, d) for i in range(2) for u in stages[i][2] for d in stages[i + 1][2]}
    assert pairs == expected
    assert all(math.isfinite(x.forward_mbit_s) for x in links)
    assert {x.forward for x in links} <= set(AUTO_FORWARD_LADDER)
    assert {x.backward for x in links} <= set(AUTO_BACKWARD_LADDER)


def test_a_narrow_model_never_sends_4_bit_activations() -> None:
    """Below width 256 4-bit activations cost more than 2% (docs/codecs.md): auto's activation ladder ends
    at int8 there, even on a link too slow for it; gradients keep int4_rot."""
    assert forward_ladder(128, zstd=False) == ("bf16", "int8")
    assert forward_ladder(256, zstd=False) == AUTO_FORWARD_LADDER
    stages, peers = chain(peer("a", up_mbit=10.0, down_mbit=10.0), peer("b", up_mbit=10.0, down_mbit=10.0))
    wide = choose_links(stages, peers, no_links(2), ELEMENTS, "auto", "auto", forward_ladder(256, zstd=False))
    narrow = choose_links(stages, peers, no_links(2), ELEMENTS, "auto", "auto", forward_ladder(128, zstd=False))
    assert (wide[0].forward, wide[0].forward_reason) == ("int4_rot", LINK_BOUND)
    assert (narrow[0].forward, narrow[0].forward_reason) == ("int8", LINK_BOUND)
    assert narrow[0].backward == wide[0].backward == "int4_rot"
    # the planner sizes an auto boundary with the smallest codec auto may pick on that model
    assert wire_bytes("auto", "auto", 128, zstd=False) == (CODEC_BYTES["int8"], GRADIENT_CODEC_BYTES["int4_rot"])
    assert wire_bytes("auto", "auto", 4096, zstd=False) == (CODEC_BYTES["int4_rot"], GRADIENT_CODEC_BYTES["int4_rot"])
    # with zstd, int3_rot ends both wide ladders, priced plain: int4_rot's size both ways
    assert wire_bytes("auto", "auto", 128, zstd=True) == (CODEC_BYTES["int8"], GRADIENT_CODEC_BYTES["int4_rot"])
    assert wire_bytes("auto", "auto", 4096, zstd=True) == (CODEC_BYTES["int3_rot"], GRADIENT_CODEC_BYTES["int3_rot"])
    assert (CODEC_BYTES["int3_rot"], GRADIENT_CODEC_BYTES["int3_rot"]) == (
        CODEC_BYTES["int4_rot"],
        GRADIENT_CODEC_BYTES["int4_rot"],
    )


def test_with_zstd_a_link_bound_wide_link_sends_int3_rot_and_a_fitting_one_keeps_int4_rot() -> None:
    """int3_rot/int3_rot is the fewest bytes within 2% of fp32 on a wide model, but only zstd-coded (plain it
    is int4_rot's size): with zstd on it ends both ladders and a link too slow for any rung gets it; where
    int4_rot fits, the less lossy int4_rot stays, since plain sizes cannot tell the two apart."""
    assert forward_ladder(256, zstd=True) == ("bf16", "int8", "int4_rot", "int3_rot")
    assert backward_ladder(256, zstd=True) == ("bf16", "int8", "int4_rot", "int3_rot")
    assert forward_ladder(256, zstd=False) == AUTO_FORWARD_LADDER
    assert backward_ladder(256, zstd=False) == AUTO_BACKWARD_LADDER
    # narrow models: int3_rot was not measured there, so neither ladder gets it
    assert forward_ladder(128, zstd=True) == ("bf16", "int8")
    assert backward_ladder(128, zstd=True) == AUTO_BACKWARD_LADDER
    stages, peers = chain(peer("a", up_mbit=10.0, down_mbit=10.0), peer("b", up_mbit=10.0, down_mbit=10.0))
    ladders = forward_ladder(256, zstd=True), backward_ladder(256, zstd=True)
    slow = choose_links(stages, peers, no_links(2), ELEMENTS, "auto", "auto", *ladders)[0]
    assert (slow.forward, slow.forward_reason, slow.backward, slow.backward_reason) == (
        "int3_rot",
        LINK_BOUND,
        "int3_rot",
        LINK_BOUND,
    )
    plain_ladders = forward_ladder(256, zstd=False), backward_ladder(256, zstd=False)
    plain = choose_links(stages, peers, no_links(2), ELEMENTS, "auto", "auto", *plain_ladders)
    assert (plain[0].forward, plain[0].backward) == ("int4_rot", "int4_rot")
    stages, peers = chain(peer("a", up_mbit=80.0, down_mbit=80.0), peer("b", up_mbit=80.0, down_mbit=80.0))
    fits = choose_links(stages, peers, no_links(2), ELEMENTS, "auto", "auto", *ladders)[0]
    assert (fits.forward, fits.forward_reason) == ("int4_rot", FITS)
