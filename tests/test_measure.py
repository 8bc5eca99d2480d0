"""A peer measures its layer throughput on the model the coordinator planned (swarm/train/measure.py).

The defect this guards: ``PeerDaemon._measure`` measured ``MODEL_PRESETS.get(plan.model_name, gpt-small)``,
so every Hugging Face run and every GPT run with a non-preset model was measured as gpt-small, and blocks
were sized from the wrong model. Here the plan is the one the real coordinator publishes before any peer
has joined (what ``find_swarm`` hands the peer), and the peer's real ``_measure`` runs on it; spies on the
layer classes record which layer ran, at which shape and dtype.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import peer.daemon as daemon_module
from coordinator.membership import make_plan
from coordinator.run_settings import RunSettings
from coordinator.swarm_run import SwarmRun
from peer.daemon import PeerDaemon
from swarm.config import HFConfig, ModelConfig, TrainConfig
from swarm.dht.schema import Plan, PlannedLayer
from swarm.train import bench, measure
from swarm.train.model import TransformerLayer
from tests.sealed_plans import peer_settings


def published_plan(tmp_path: Path, model: ModelConfig, train: TrainConfig, **kw) -> Plan:
    """The first plan a coordinator publishes (no peers yet: "the swarm exists, come in")."""
    settings = RunSettings(name="run", run_dir=tmp_path, model=model, train=train, peers=2, **kw)
    run = SwarmRun(settings, SimpleNamespace(s=SimpleNamespace(heartbeat=1.0)))
    run.planning.control_endpoint = "/ip4/127.0.0.1/tcp/1"
    return Plan.model_validate_json(run.planning.publishable([(0, model.n_layers, [])]).model_dump_json())


def measured_by_peer(plan: Plan, monkeypatch: pytest.MonkeyPatch) -> float:
    async def no_link(*_args):
        return 1e6, 1e6

    async def no_channel(*_args):
        return None

    async def go() -> float:
        daemon = PeerDaemon(peer_settings("p0", device="cpu"))
        daemon.endpoint = "/ip4/127.0.0.1/tcp/2"
        monkeypatch.setattr(daemon.channels, "coordinator", no_channel)
        try:
            return (await daemon._measure(plan)).throughput_layers_per_s
        finally:
            await asyncio.to_thread(daemon.compute.close)

    monkeypatch.setattr(daemon_module, "measure_bandwidth", no_link)
    return asyncio.run(go())


def spy(monkeypatch: pytest.MonkeyPatch, cls: type, calls: list) -> None:
    original = cls.forward

    def forward(self, hidden, *args, **kwargs):
        calls.append((tuple(hidden.shape), hidden.dtype))
        return original(self, hidden, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)


def test_a_gpt_run_is_measured_on_its_own_model_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = ModelConfig(n_layers=4, d_model=96, n_heads=3, context=48)  # no preset has this shape
    plan = published_plan(tmp_path, model, TrainConfig(micro_batch_size=3), model_name="custom")
    calls: list = []
    spy(monkeypatch, TransformerLayer, calls)
    assert measured_by_peer(plan, monkeypatch) > 0
    assert calls and set(calls) == {((3, 48, 96), torch.float32)}


def test_a_checkpoint_run_is_measured_on_one_layer_of_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from swarm.train.hf.loader import CheckpointReader
    from swarm.train.hf.quant import Int8Linear
    from swarm.train.hf.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "llama", "llama", hidden=48)
    hf = HFConfig(path=str(ckpt), dtype="bf16", quant="int8", lora_rank=4)
    model = ModelConfig(n_layers=4, d_model=48, n_heads=4, vocab_size=320, context=16)
    plan = published_plan(tmp_path / "run", model, TrainConfig(micro_batch_size=2), model_name="hf:llama", hf=hf)
    layers: list = []
    int8: list = []
    gpt: list = []
    spy(monkeypatch, LlamaDecoderLayer, layers)
    spy(monkeypatch, Int8Linear, int8)
    spy(monkeypatch, TransformerLayer, gpt)
    reads: list = []
    monkeypatch.setattr(CheckpointReader, "read", lambda self, names: reads.append(list(names)))

    assert measured_by_peer(plan, monkeypatch) > 0
    assert not gpt, "a checkpoint run was measured on the built-in GPT"
    assert layers and set(layers) == {((2, 16, 48), torch.bfloat16)}
    assert int8, "the int8 base was not measured"
    assert not reads, "measuring read the checkpoint's weights"


def test_an_nf4_checkpointed_run_is_measured_with_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    import torch.utils.checkpoint

    from swarm.train.hf.nf4 import NF4Linear
    from swarm.train.hf.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "llama", "llama", hidden=48)
    hf = HFConfig(path=str(ckpt), dtype="bf16", quant="nf4", lora_rank=4, activation_checkpointing=True)
    model = ModelConfig(n_layers=4, d_model=48, n_heads=4, vocab_size=320, context=16)
    plan = published_plan(tmp_path / "run", model, TrainConfig(micro_batch_size=2), model_name="hf:llama", hf=hf)
    assert plan.layer.hf_quant == "nf4" and plan.layer.activation_checkpointing
    nf4: list = []
    spy(monkeypatch, NF4Linear, nf4)
    recomputed: list = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: recomputed.append(1) or original(*a, **k))
    assert measured_by_peer(plan, monkeypatch) > 0
    assert nf4, "the NF4 base was not measured"
    assert recomputed, "activation checkpointing was not measured"


def test_the_fastest_of_a_few_repeats_is_kept() -> None:
    """Interference (another process on a shared core) only ever slows a repeat down."""
    clock = [0.0]
    costs = iter([1.0] + [5.0, 1.0, 1.0, 4.0, 1.0] * 100)  # warm-up, then passes with interference

    def once() -> None:
        clock[0] += next(costs)

    rate = bench.best_rate(once, repeats=5, repeat_seconds=2.0, max_seconds=1e9, clock=lambda: clock[0])
    assert rate == pytest.approx(1.0)


def test_gpt2_checkpoints_are_measured_too(tmp_path: Path) -> None:
    """GPT-2 keeps its weights in ``Conv1D`` (stored (in, out)) and has no rotary embeddings."""
    pytest.importorskip("transformers")
    from swarm.train.hf.measure import hf_layer_throughput
    from swarm.train.hf.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "gpt2", "gpt2", hidden=32)
    rate = hf_layer_throughput(ckpt, "cpu", dtype="fp32", quant="int8", lora_rank=2, context=8, batch=1)
    assert rate > 0


def a_plan(model_name: str, layer: PlannedLayer | None) -> Plan:
    return make_plan(
        swarm="s",
        run_id="r",
        version=1,
        model_name=model_name,
        coordinator="/ip4/127.0.0.1/tcp/1",
        stages=[(0, 2, [])],
        layer=layer,
    )


def test_a_plan_that_names_no_layer_is_measured_by_its_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator from before the layer field: the old rule, the preset of that name."""
    calls: list = []
    spy(monkeypatch, TransformerLayer, calls)
    assert measure.planned_throughput(a_plan("gpt-tiny", None), "cpu") > 0
    assert set(calls) == {((4, 64, 64), torch.float32)}


def test_a_checkpoint_missing_here_is_measured_as_a_gpt_layer_as_wide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer still announces; its assignment then fails with the reason (swarm/train/stage_factory.py)."""
    layer = PlannedLayer(d_model=32, n_heads=2, context=8, micro_batch_size=1, hf_path=str(tmp_path / "absent"))
    calls: list = []
    spy(monkeypatch, TransformerLayer, calls)
    assert measure.planned_throughput(a_plan("hf:absent", layer), "cpu") > 0
    assert set(calls) == {((1, 8, 32), torch.float32)}
    assert "cannot measure a layer of the checkpoint" in caplog.text


def test_on_cpu_time_spent_waiting_for_the_cores_does_not_count() -> None:
    """Peers started together contend for the same cores; the CPU clock counts only the work itself."""
    clock = bench.device_clock(torch.device("cpu"))
    t0 = clock()
    time.sleep(0.3)  # off the CPU, as a process is while others hold the cores
    assert clock() - t0 < 0.05
    assert bench.device_clock(torch.device("cuda")) is time.perf_counter
