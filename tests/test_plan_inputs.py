"""The coordinator sizes blocks by what peers measured: faster peers get more layers, small ones fewer."""

from __future__ import annotations

import time

import pytest

from coordinator.cost_model import InfeasiblePlanError
from coordinator.plan_inputs import model_spec, peer_specs
from coordinator.planner import plan
from swarm.config import PROTOCOL_VERSION, ModelConfig, TrainConfig
from swarm.dht_schema import PeerRecord

MODEL = ModelConfig(n_layers=8, d_model=256, n_heads=8, context=128)
TRAIN = TrainConfig(micro_batches=4, micro_batch_size=4, wire_forward="int4_rot", wire_backward="int8")


def record(peer_id: str, speed: float, memory: float = 8e9, link: float = 50e6) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        endpoint=f"/ip4/127.0.0.1/tcp/{1000 + len(peer_id)}",
        device="cpu",
        free_memory_bytes=int(memory),
        throughput_layers_per_s=speed,
        bandwidth_up_bytes_per_s=link,
        bandwidth_down_bytes_per_s=link,
        state="joining",
        software_version="0.1.0",
        protocol_version=PROTOCOL_VERSION,
        timestamp=time.time(),
    )


def test_a_faster_peer_gets_more_layers() -> None:
    p = plan(
        peer_specs([record("fast", 40.0), record("slow-a", 10.0), record("slow-b", 10.0)]),
        model_spec(MODEL, TRAIN),
        replicas=False,
    )
    sizes = {pid: st.layer_end - st.layer_start for st in p.stages for pid in st.peer_ids}
    assert sizes["fast"] > sizes["slow-a"] and sizes["fast"] > sizes["slow-b"]
    assert sum(sizes.values()) == MODEL.n_layers


def test_memory_bounds_the_block_and_impossible_swarms_say_why() -> None:
    spec = model_spec(MODEL, TRAIN)
    per_layer = spec.layer_memory[0]
    p = plan(
        peer_specs([record("big", 10.0, memory=8 * per_layer), record("tiny", 100.0, memory=2.5 * per_layer)]),
        spec,
        replicas=False,
    )
    tiny = next(st for st in p.stages if "tiny" in st.peer_ids)
    assert tiny.layer_end - tiny.layer_start <= 2
    with pytest.raises(InfeasiblePlanError):
        plan(
            peer_specs([record("a", 10.0, memory=per_layer), record("b", 10.0, memory=per_layer)]), spec, replicas=False
        )


def test_codecs_shrink_boundary_bytes() -> None:
    fp32 = model_spec(MODEL, TrainConfig(micro_batches=4, micro_batch_size=4))
    packed = model_spec(MODEL, TRAIN)
    assert fp32.forward_bytes[0] / packed.forward_bytes[0] > 7
    assert fp32.backward_bytes[0] / packed.backward_bytes[0] > 3.5


def test_every_peer_gets_a_block_sized_by_its_speed() -> None:
    from coordinator.plan_inputs import plan_every_peer

    p = plan_every_peer(
        peer_specs([record("fast", 40.0), record("slow", 0.5), record("mid", 10.0)]), model_spec(MODEL, TRAIN)
    )
    sizes = {pid: st.layer_end - st.layer_start for st in p.stages for pid in st.peer_ids}
    assert set(sizes) == {"fast", "slow", "mid"} and sum(sizes.values()) == MODEL.n_layers
    assert sizes["slow"] == 1 and sizes["fast"] > sizes["mid"]
    tiny = ModelConfig(n_layers=3, d_model=64, n_heads=2, context=64)
    p = plan_every_peer(peer_specs([record("a", 1.0), record("b", 50.0), record("c", 7.0)]), model_spec(tiny, TRAIN))
    assert [st.layer_end - st.layer_start for st in p.stages] == [1, 1, 1]


def test_noisy_measurements_of_equal_peers_give_an_even_split() -> None:
    from coordinator.plan_inputs import plan_every_peer

    six = ModelConfig(n_layers=6, d_model=256, n_heads=8, context=128)
    p = plan_every_peer(peer_specs([record("a", 11.0), record("b", 9.0), record("c", 10.0)]), model_spec(six, TRAIN))
    assert [st.layer_end - st.layer_start for st in p.stages] == [2, 2, 2]
