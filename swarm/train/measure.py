"""What a peer measures about itself before it joins: device, free memory, compute throughput.

The planner needs comparable numbers from very different machines, so the benchmark is the real work of
the run: forward and backward of one layer of the planned model on one of the run's micro-batches. The
signed plan says which (``swarm.dht.schema.PlannedLayer``, filled by the coordinator with
:func:`planned_layer`): the built-in GPT at the run's ``ModelConfig``, or one layer of a Hugging Face
checkpoint in its own architecture, dtype and int8 base with LoRA adapters, built from ``config.json``
with random weights (``swarm.train.hf.measure``): speed does not depend on the values, so no weights are read.

Measuring runs at every peer start, often on cores that other processes share, so it is short and keeps
the fastest of a few short repeats (``swarm.train.bench.best_rate`` says why).
"""

from __future__ import annotations

import logging
import os

import torch

from swarm.config import MODEL_PRESETS, HFConfig, ModelConfig, TrainConfig
from swarm.dht.schema import Plan, PlannedLayer
from swarm.train.bench import best_rate, device_clock, synchronizer
from swarm.train.model import TransformerLayer

log = logging.getLogger(__name__)


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} {torch.cuda.get_device_name(torch.device(device))}"[:128]
    return "cpu"


def free_memory_bytes(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 0


def planned_layer(model: ModelConfig, train: TrainConfig, hf: HFConfig | None) -> PlannedLayer:
    """What the coordinator tells peers to measure: one layer of this run's model on one micro-batch."""
    return PlannedLayer(
        d_model=model.d_model,
        n_heads=model.n_heads,
        context=model.context,
        micro_batch_size=train.micro_batch_size,
        hf_path=hf.path if hf is not None else "",
        hf_dtype=hf.dtype if hf is not None else "bf16",
        hf_quant=hf.quant if hf is not None else "none",
        activation_checkpointing=hf is not None and hf.activation_checkpointing,
        lora_rank=hf.lora_rank if hf is not None else 0,
    )


def planned_throughput(plan: Plan, device: str, hf_path: str = "") -> float:
    """Layer passes per second on the layer ``plan`` names; ``hf_path``: this peer's copy of the checkpoint.

    A checkpoint that cannot be read here is measured as a GPT layer of its width instead (with a warning):
    the peer still announces, and the assignment then fails with the reason for the coordinator to see.
    """
    layer = plan.layer
    if layer is None:  # a coordinator that did not say: its model by preset name, as before
        return layer_throughput(MODEL_PRESETS.get(plan.model_name, MODEL_PRESETS["gpt-small"]), device)
    if layer.hf_path:
        path = hf_path or layer.hf_path
        try:
            from swarm.train.hf.measure import cpu_dtype_hint, hf_layer_throughput

            if torch.device(device).type == "cpu" and (hint := cpu_dtype_hint(layer.hf_dtype)):
                log.warning("%s", hint)
            return hf_layer_throughput(
                path,
                device,
                dtype=layer.hf_dtype,
                quant=layer.hf_quant,
                lora_rank=layer.lora_rank,
                context=layer.context,
                batch=layer.micro_batch_size,
                activation_checkpointing=layer.activation_checkpointing,
            )
        except (ImportError, OSError, ValueError, KeyError, NotImplementedError) as e:
            log.warning(
                "cannot measure a layer of the checkpoint at %s (%s); measuring a GPT layer of its width", path, e
            )
    heads = layer.n_heads if layer.d_model % layer.n_heads == 0 else 1
    cfg = ModelConfig(n_layers=1, d_model=layer.d_model, n_heads=heads, context=layer.context)
    return layer_throughput(cfg, device, batch=layer.micro_batch_size)


def layer_throughput(cfg: ModelConfig, device: str, *, batch: int = 4) -> float:
    """Forward+backward passes of one built-in GPT layer per second on a (batch, context) micro-batch."""
    dev = torch.device(device)
    layer = TransformerLayer(cfg).to(dev)
    x = torch.randn(batch, cfg.context, cfg.d_model, device=dev, requires_grad=True)

    def once() -> None:
        layer(x).sum().backward()

    return best_rate(once, sync=synchronizer(dev), clock=device_clock(dev))
