"""What peers announced and what the run trains become placement's inputs."""

from __future__ import annotations

import time

from coordinator.plan_inputs import block_overhead, hf_settings, model_spec, peer_specs
from swarm.config import PROTOCOL_VERSION, HFConfig, ModelConfig, TrainConfig
from swarm.dht.schema import PeerRecord

MODEL = ModelConfig(n_layers=8, d_model=256, n_heads=8, context=128)
TRAIN = TrainConfig(micro_batches=4, micro_batch_size=4, wire_forward="int4_rot", wire_backward="int8")


def record(peer_id: str, speed: float, reachable: bool | None = None) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        endpoint="/ip4/127.0.0.1/tcp/1000",
        device="cpu",
        free_memory_bytes=int(8e9),
        throughput_layers_per_s=speed,
        bandwidth_up_bytes_per_s=0.0,
        bandwidth_down_bytes_per_s=50e6,
        state="joining",
        software_version="0.1.0",
        protocol_version=PROTOCOL_VERSION,
        timestamp=time.time(),
        reachable=reachable,
    )


def test_measurements_pass_through_raw_and_unmeasured_ones_stay_positive() -> None:
    specs = peer_specs([record("a", 11.0), record("b", 0.0, reachable=False), record("c", 30.0, reachable=True)])
    assert [s.speed for s in specs] == [11.0, 1e-3, 30.0]  # noise is placement's decision, not this module's
    assert [s.reachable for s in specs] == [True, False, True]  # unknown reachability counts as reachable
    assert specs[0].upload > 0 and specs[0].download == 50e6


def test_codecs_shrink_boundary_bytes() -> None:
    fp32 = model_spec(MODEL, TrainConfig(micro_batches=4, micro_batch_size=4))
    packed = model_spec(MODEL, TRAIN)
    assert fp32.forward_bytes[0] / packed.forward_bytes[0] > 7
    assert fp32.backward_bytes[0] / packed.backward_bytes[0] > 3.5


def test_a_frozen_hf_base_needs_less_memory_per_layer_than_full_training() -> None:
    full = model_spec(MODEL, TRAIN).layer_memory[0]
    lora = model_spec(MODEL, TRAIN, HFConfig(path="x")).layer_memory[0]
    assert lora < full


def test_a_hf_checkpoint_is_planned_from_its_config_by_the_memory_model() -> None:
    from pathlib import Path

    from coordinator import memory_model as mm

    path = str(Path(__file__).resolve().parent.parent / "docs" / "configs" / "llama-3-70b.json")
    model = ModelConfig(n_layers=80, d_model=8192, n_heads=64, vocab_size=128256, context=512)
    hf = HFConfig(path=path, quant="nf4")
    spec = model_spec(model, TRAIN, hf)
    arch, settings = mm.Arch.from_path(path), hf_settings(model, TRAIN, hf)
    assert spec.layer_memory == mm.layer_memory(arch, settings)
    assert spec.last_layer_memory == mm.last_layer_memory(arch, settings) < spec.layer_memory  # one micro-batch
    assert spec.layer_memory[0] > spec.layer_memory[1] < spec.layer_memory[-1]  # embedding, head and logits
    assert spec.layer_cost[:-1] == (1.0,) * 79 and spec.layer_cost[-1] > 1.0  # the head costs compute too
    assert spec.forward_bytes[0] == 4 * 512 * 8192 * (0.5 + 2 / 64)  # int4_rot activations
    overhead = block_overhead(model, TRAIN, hf)
    assert overhead == mm.stage_overhead_bytes(arch, settings) > 0 == block_overhead(model, TRAIN, None)
    assert peer_specs([record("a", 1.0)], overhead=overhead)[0].free_memory == 8e9 - overhead


def test_a_no_fit_line_names_what_each_peer_offered_even_below_a_blocks_overhead() -> None:
    """Peers' memory reaches placement less the per-block overhead, floored at 0; the line a user reads must name
    the offer itself (a 1 MiB peer was shown as the 2 MiB overhead of an async LoRA block)."""
    from coordinator.cost_model import ModelSpec
    from coordinator.placement import NoFit
    from coordinator.planning import no_fit_message

    overhead, mib = 2 * 2**20, 2**20
    records = [record("small", 1.0).model_copy(update={"free_memory_bytes": mib})]
    peers = peer_specs(records, overhead=overhead)
    assert peers[0].free_memory == 0.0
    spec = ModelSpec(
        layer_cost=(1.0,) * 4, layer_memory=(19 * mib,) * 4, forward_bytes=(0.0,) * 3, backward_bytes=(0.0,) * 3
    )
    line = no_fit_message(spec, peers, NoFit("no split fits"), overhead=overhead, offered={"small": float(mib)})
    assert "the peers offer small 1 MiB;" in line and "plus 2 MiB per block" in line, line
