"""Placement: optimal against brute force, stable for equal peers, replicas and the NAT rule, explained errors.

The brute force re-implements the cost model from its docstring in plain Python, so a mistake in the
vectorised model shows up as a disagreement rather than being shared.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coordinator.cost_model import ModelSpec, PeerSpec
from coordinator.placement import (
    MIN_GAIN_OVER_EVEN,
    SPEED_NOISE,
    BadReplicas,
    NoFit,
    NoPeers,
    Placement,
    TooManyStages,
    Unarrangeable,
    place,
    steady,
)
from coordinator.plan_inputs import model_spec, peer_specs
from coordinator.reachability import conflicts
from swarm.config import PROTOCOL_VERSION, ModelConfig, TrainConfig
from swarm.dht.schema import PeerRecord

FAST = settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
MEDIUM = ModelConfig(n_layers=6, d_model=256, n_heads=8, context=128)  # gpt-medium
TRAIN = TrainConfig(micro_batches=4, micro_batch_size=4)  # fp32 on the wire: link terms at their largest


def ref_time(p: PeerSpec, m: ModelSpec, a: int, b: int) -> float:
    L = m.n_layers
    if sum(m.layer_memory[a:b]) > p.free_memory:
        return math.inf

    def fwd(i: int) -> float:
        return m.forward_bytes[i - 1] if 0 < i < L else 0.0

    def bwd(i: int) -> float:
        return m.backward_bytes[i - 1] if 0 < i < L else 0.0

    return sum(m.layer_cost[a:b]) / p.speed + (fwd(a) + bwd(b)) / p.download + (fwd(b) + bwd(a)) / p.upload


def brute(peers: list[PeerSpec], m: ModelSpec, even: bool = False) -> float:
    """Every order of the peers that keeps NAT peers apart, every split into one block per peer."""
    L, n = m.n_layers, len(peers)
    reach = {p.peer_id: p.reachable for p in peers}
    best = math.inf
    for cuts in itertools.combinations(range(1, L), n - 1):
        bounds = (0, *cuts, L)
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        if even and max(sizes) - min(sizes) > 1:
            continue
        for order in itertools.permutations(peers):
            if conflicts([p.peer_id for p in order], reach):
                continue
            blocks = zip(order, itertools.pairwise(bounds), strict=True)
            best = min(best, max(ref_time(p, m, a, b) for p, (a, b) in blocks))
    return best


@st.composite
def swarms(draw, max_peers: int = 4, max_layers: int = 6):
    L = draw(st.integers(2, max_layers))
    n = draw(st.integers(2, min(max_peers, L)))
    uniform = draw(st.booleans())
    pos = st.floats(0.3, 3.0)
    if uniform:
        model = ModelSpec.uniform(
            L, layer_memory=100.0, boundary_bytes=draw(st.floats(0, 3)), backward_bytes=draw(st.floats(0, 3))
        )
    else:
        model = ModelSpec(
            tuple(draw(pos) for _ in range(L)),
            tuple(100.0 * draw(st.integers(1, 3)) for _ in range(L)),
            tuple(draw(st.floats(0, 3)) for _ in range(L - 1)),
            tuple(draw(st.floats(0, 3)) for _ in range(L - 1)),
        )
    peers = [
        PeerSpec(
            f"p{i}",
            speed=draw(st.floats(0.1, 10.0)),
            free_memory=100.0 * draw(st.integers(1, 4 * L // n)),
            upload=draw(st.floats(0.5, 10.0)),
            download=draw(st.floats(0.5, 10.0)),
            reachable=draw(st.booleans()) if draw(st.booleans()) else True,
        )
        for i in range(n)
    ]
    return peers, model


def placed_or_inf(peers: list[PeerSpec], model: ModelSpec, **kw) -> float:
    try:
        result = place(peers, model, **kw)
    except (NoFit, Unarrangeable):
        return math.inf
    check(result, peers, model)
    return result.bottleneck_time


def check(result: Placement, peers: list[PeerSpec], model: ModelSpec) -> None:
    """Contiguous blocks cover every layer once; every peer holds one; the NAT rule holds."""
    bounds = [(b.layer_start, b.layer_end) for b in result.blocks]
    assert bounds[0][0] == 0 and bounds[-1][1] == model.n_layers
    assert all(a < b for a, b in bounds) and all(x[1] == y[0] for x, y in itertools.pairwise(bounds))
    held = [p for b in result.blocks for p in b.peer_ids]
    assert sorted(held) == sorted(p.peer_id for p in peers)
    assert not conflicts([b.peer_ids[0] for b in result.blocks], {p.peer_id: p.reachable for p in peers})


@FAST
@given(swarms())
def test_without_the_noise_rule_placement_is_the_brute_force_optimum(case) -> None:
    peers, model = case
    got = placed_or_inf(peers, model, noise=1.0, margin=0.0)
    best = brute(peers, model)
    assert got == pytest.approx(best, rel=1e-9) if math.isfinite(best) else got == math.inf


@FAST
@given(swarms())
def test_with_the_noise_rule_placement_is_within_the_stated_margin(case) -> None:
    """Among equal peers the even split is kept while the optimum (on steadied measurements) beats it by <= the
    margin; otherwise placement is the optimum."""
    peers, model = case
    calm = steady(peers)
    best = brute(calm, model)
    if not math.isfinite(best):
        assert placed_or_inf(peers, model) == math.inf
        return
    result = place(peers, model)
    check(result, peers, model)
    if result.even:
        assert result.bottleneck_time == pytest.approx(brute(calm, model, even=True), rel=1e-9)
        equals = len({p.speed for p in calm}) == 1
        assert result.bottleneck_time <= best * (1 + (MIN_GAIN_OVER_EVEN if equals else 1e-9)) * (1 + 1e-9)
    else:
        assert result.bottleneck_time == pytest.approx(best, rel=1e-9)


@FAST
@given(
    n=st.integers(2, 4),
    layers=st.integers(4, 8),
    noise=st.lists(st.floats(1 / 1.2, 1.2), min_size=4, max_size=4),
    links=st.lists(st.floats(1 / 2.9, 2.9), min_size=4, max_size=4),
)
def test_identical_peers_with_noisy_measurements_get_an_even_split(n, layers, noise, links) -> None:
    """Any spread within ``SPEED_NOISE`` of the median in speed and within 2.9x in link, on a loopback-fast link."""
    mid = statistics.median_high(noise[:n])
    assume(all(mid / SPEED_NOISE <= v <= mid * SPEED_NOISE for v in noise[:n]))
    spec = model_spec(ModelConfig(n_layers=layers, d_model=256, n_heads=8, context=128), TRAIN)
    peers = [PeerSpec(f"p{i}", 20.0 * noise[i], 8e9, 3e8 * links[i], 3e8 / links[i]) for i in range(n)]
    sizes = [b.layer_end - b.layer_start for b in place(peers, spec).blocks]
    assert max(sizes) - min(sizes) <= 1, sizes


def record(peer_id: str, speed: float, memory: float = 8e9, link: float = 3e8, reachable: bool = True) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        endpoint="/ip4/127.0.0.1/tcp/1000",
        device="cpu",
        free_memory_bytes=int(memory),
        throughput_layers_per_s=speed,
        bandwidth_up_bytes_per_s=link,
        bandwidth_down_bytes_per_s=link,
        state="joining",
        software_version="0.1.0",
        protocol_version=PROTOCOL_VERSION,
        timestamp=time.time(),
        reachable=reachable,
    )


def sizes_of(result: Placement) -> list[int]:
    return [b.layer_end - b.layer_start for b in result.blocks]


def test_three_equal_peers_measured_apart_split_six_layers_evenly() -> None:
    """The defect: identical peers measured apart were split 2/1/3 and 1/1/4 (the ±25% band was too narrow).

    The 2.4x spreads of wall-clock timing are gone (CPU time, tests/test_measure.py); what is left of noise
    on a real machine, here 1.4x / 0.7x of the median, must still give an even split."""
    base = 20.0
    records = [record("peer-0", 1.0 * base), record("peer-1", 1.4 * base), record("peer-2", 0.7 * base)]
    assert sizes_of(place(peer_specs(records), model_spec(MEDIUM, TRAIN))) == [2, 2, 2]


def test_two_survivors_are_replanned_evenly() -> None:
    """After a SIGKILL the survivors, 2.5x apart by wall-clock measurement, were re-planned 1/5; within the
    noise that CPU-time measuring leaves (here 1.4x) they get 3/3."""
    result = place(peer_specs([record("peer-0", 14.0), record("peer-2", 20.0)]), model_spec(MEDIUM, TRAIN))
    assert sizes_of(result) == [3, 3]


def test_a_truly_faster_peer_still_gets_a_bigger_block() -> None:
    result = place(peer_specs([record("fast", 80.0), record("a", 20.0), record("b", 20.0)]), model_spec(MEDIUM, TRAIN))
    sizes = {b.peer_ids[0]: b.layer_end - b.layer_start for b in result.blocks}
    assert not result.even and sizes["fast"] > sizes["a"] and sizes["fast"] > sizes["b"]
    assert sum(sizes.values()) == MEDIUM.n_layers


def test_memory_caps_and_loopback_links_keep_identical_peers_even() -> None:
    spec = model_spec(MEDIUM, TRAIN)
    for room in (2, 3, 6):  # each peer can hold exactly 2, 3 or all 6 layers
        peers = peer_specs([record(f"p{i}", 20.0, memory=room * spec.layer_memory[0]) for i in range(3)])
        assert sizes_of(place(peers, spec)) == [2, 2, 2]
    slow_link = peer_specs([record(f"p{i}", 20.0, link=5e6) for i in range(3)])  # 0.1 s per boundary each way
    assert sizes_of(place(slow_link, spec)) == [2, 2, 2]


def test_a_joining_slower_peer_gets_the_optimum_not_an_even_split_worse_than_before() -> None:
    """Peers that differ beyond noise are not held to the even split: here 3/3 would predict less than the
    first peer alone, while 5/1 predicts more (the join test's case: a peer measured under load)."""
    spec = model_spec(ModelConfig(n_layers=6, d_model=128, n_heads=4, context=128), TrainConfig(micro_batches=4))
    alone = place(peer_specs([record("first", 200.0, link=1e9)]), spec)
    both = place(peer_specs([record("first", 200.0, link=1e9), record("second", 60.0, link=1e9)]), spec)
    assert not both.even and sizes_of(both) == [5, 1] and both.throughput > 1.05 * alone.throughput


def test_memory_bounds_a_block_and_impossible_memory_says_why() -> None:
    spec = model_spec(ModelConfig(n_layers=8, d_model=256, n_heads=8, context=128), TRAIN)
    per_layer = spec.layer_memory[0]
    result = place(peer_specs([record("big", 10.0, 8 * per_layer), record("tiny", 100.0, 2.5 * per_layer)]), spec)
    assert {b.peer_ids[0]: b.layer_end - b.layer_start for b in result.blocks}["tiny"] <= 2
    with pytest.raises(NoFit, match="fits their memory"):
        place(peer_specs([record("a", 10.0, per_layer), record("b", 10.0, per_layer)]), spec)


def test_impossible_inputs_are_explained() -> None:
    spec = model_spec(MEDIUM, TRAIN)
    peers = peer_specs([record(f"p{i}", 20.0) for i in range(4)])
    with pytest.raises(NoPeers):
        place([], spec)
    with pytest.raises(TooManyStages, match="at most one stage per layer"):
        place(peers, spec, stages=7)
    with pytest.raises(BadReplicas, match="at least 2 stages"):
        place(peers, spec, stages=1)
    with pytest.raises(BadReplicas, match="cannot be replicated"):
        place(peers, spec, stages=3, replicate=0)
    with pytest.raises(BadReplicas, match="only stages 0..2"):
        place(peers, spec, stages=3, replicate=3)
    nat = peer_specs([record(f"n{i}", 20.0, reachable=False) for i in range(3)] + [record("open", 20.0)])
    with pytest.raises(Unarrangeable, match="behind NAT"):
        place(nat, spec)
    assert all(isinstance(e, ValueError) for e in (NoPeers(), TooManyStages(), NoFit(), BadReplicas(), Unarrangeable()))


def test_spares_replicate_the_slowest_stage_never_the_first() -> None:
    spec = model_spec(MEDIUM, TRAIN)
    peers = peer_specs([record("a", 20.0), record("b", 20.0), record("c", 20.0), record("slow", 2.0)])
    result = place(peers, spec, stages=3)
    assert [len(b.peer_ids) for b in result.blocks][0] == 1
    assert "slow" in next(b.peer_ids for b in result.blocks if len(b.peer_ids) > 1)[1:]
    assert sizes_of(result) == [2, 2, 2]
    pinned = place(peers, spec, stages=3, replicate=1)
    assert pinned.blocks[1].peer_ids[1:] == ("slow",)
    assert pinned.blocks[1].time < pinned.blocks[2].time  # a replica shares the stage's micro-batches
    assert sizes_of(place(peers[:2], spec, stages=3)) == [3, 3]  # survivors of a 3-stage run: 2 stages
    more_than_layers = place(peer_specs([record(f"p{i}", 20.0) for i in range(8)]), spec)
    assert len(more_than_layers.blocks) == 6 and len(more_than_layers.blocks[0].peer_ids) == 1


def test_peers_behind_nat_hold_chain_blocks_apart() -> None:
    spec = model_spec(MEDIUM, TRAIN)
    records = [record("a", 20.0), record("b", 20.0, reachable=False), record("c", 20.0, reachable=False)]
    result = place(peer_specs([*records, record("d", 20.0)]), spec, stages=3)
    chain = [b.peer_ids[0] for b in result.blocks]
    assert {"b", "c"} <= set(chain) and chain.index("b") + chain.index("c") == 2  # at both ends
    assert sizes_of(result) == [2, 2, 2]


def test_placement_is_deterministic_and_ignores_input_order() -> None:
    spec = model_spec(MEDIUM, TRAIN)
    peers = peer_specs([record("c", 11.0), record("a", 30.0), record("b", 19.0)])
    assert place(peers, spec) == place(list(reversed(peers)), spec)


def test_large_swarms_are_placed_quickly() -> None:
    spec = model_spec(ModelConfig(n_layers=48, d_model=64, n_heads=2, context=64), TRAIN)
    peers = [PeerSpec(f"p{i:02}", 1.0 + (i % 5) * 2.0, 1e12, 1e8, 1e8, reachable=i % 3 != 0) for i in range(24)]
    start = time.perf_counter()
    result = place(peers, spec)
    assert time.perf_counter() - start < 5.0
    check(result, peers, spec)


def test_the_last_block_may_count_its_layers_differently() -> None:
    """The last stage keeps one micro-batch's activations (forward, loss and backward back to back), so a
    peer too small for any other block can still hold the tail."""
    uniform = ModelSpec.uniform(4, layer_memory=10.0, boundary_bytes=0.0)
    light_tail = ModelSpec(
        uniform.layer_cost, uniform.layer_memory, uniform.forward_bytes, uniform.backward_bytes, (4.0,) * 4
    )
    peers = [PeerSpec("big", 1.0, 20.0, 1e9, 1e9), PeerSpec("small", 1.0, 8.0, 1e9, 1e9)]
    with pytest.raises(NoFit):
        place(peers, uniform)
    result = place(peers, light_tail)
    assert sizes_of(result) == [2, 2] and result.blocks[-1].peer_ids == ("small",)
    with pytest.raises(ValueError, match="last_layer_memory has 3 entries"):
        ModelSpec(uniform.layer_cost, uniform.layer_memory, uniform.forward_bytes, uniform.backward_bytes, (1.0,) * 3)
