"""Turn what peers announced and what the run trains into placement's inputs.

Placement (``coordinator/placement.py``) works on a cost model in seconds per micro-batch; this is where
Ravn's real numbers are mapped onto it: a peer's measured layer throughput (forward+backward of one layer
on one micro-batch), its memory, its link and whether it accepts connections, and per layer the memory
and the bytes each boundary carries per micro-batch after the wire codecs.

For a Hugging Face checkpoint the per-layer numbers come from ``coordinator/memory_model.py``, read from
its ``config.json``, the same arithmetic ``ravn plan`` uses for hypothetical peers, so what the command
promises is what the runtime plans.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator import memory_model as mm
from coordinator.cost_model import ModelSpec, PeerSpec
from swarm.config import (
    DEFAULT_WIRE_RANK,
    HFConfig,
    ModelConfig,
    TrainConfig,
    backward_ladder,
    forward_ladder,
    planned_codec,
)
from swarm.dht.schema import PeerRecord

# bytes per element on the wire, counting the fp16 scale of each 64-element block
CODEC_BYTES = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "int8": 1 + 2 / 64,
    "int4": 0.5 + 2 / 64,
    "int4_rot": 0.5 + 2 / 64,
    "int3_rot": 0.5 + 2 / 64,  # plain; zstd-coded 0.31-0.43 of it on gpt-medium (docs/codecs.md), not planned on
    # priced as int3_rot: zstd-coded (it travels no other way) it sent what int3_rot sends, on gpt-medium's
    # gradients with error feedback (docs/codecs.md, "ecsq"); plain it would be int8's size
    "ecsq": 0.5 + 2 / 64,
}
# gradients w.r.t. hidden states are ~1e-7, so integer codecs send them with fp32 scales (swarm/wire/quantize.py)
SCALED_CODECS = ("int8", "int4", "int4_rot", "int3_rot")
GRADIENT_CODEC_BYTES = {c: b + (2 / 64 if c in SCALED_CODECS else 0.0) for c, b in CODEC_BYTES.items()}
GRADIENT_CODEC_BYTES["ecsq"] = GRADIENT_CODEC_BYTES["int3_rot"]
ACTIVATION_TENSORS_PER_LAYER = 16  # saved tensors of one pre-norm block per token and channel, roughly
MIN_SPEED = 1e-3
MIN_BANDWIDTH = 1e3


def peer_specs(records: Sequence[PeerRecord], *, overhead: float = 0.0) -> list[PeerSpec]:
    """Measured claims as placement input; a peer that measured nothing still gets a tiny positive rate.

    The raw measurements go in: placement itself decides what is measurement noise (``placement.steady``).
    ``overhead`` (``block_overhead``) is what any block costs whatever its size, taken off each peer's memory
    because placement's memory is a sum over layers.
    """
    return [
        PeerSpec(
            peer_id=r.peer_id,
            speed=max(r.throughput_layers_per_s, MIN_SPEED),
            free_memory=max(float(r.free_memory_bytes) - overhead, 0.0),
            upload=max(r.bandwidth_up_bytes_per_s, MIN_BANDWIDTH),
            download=max(r.bandwidth_down_bytes_per_s, MIN_BANDWIDTH),
            reachable=r.reachable is not False,
        )
        for r in records
    ]


def hf_settings(model: ModelConfig, train: TrainConfig, hf: HFConfig) -> mm.Settings:
    """The memory model's view of a LoRA run: sequence length from the run's ``ModelConfig``."""
    return mm.Settings(
        dtype=hf.dtype,
        quant=hf.quant,
        lora_rank=hf.lora_rank,
        lora_targets=tuple(hf.lora_targets),
        micro_batch_size=train.micro_batch_size,
        context=model.context,
        in_flight=train.in_flight_limit,
        activation_checkpointing=hf.activation_checkpointing,
    )


def block_overhead(model: ModelConfig, train: TrainConfig, hf: HFConfig | None) -> float:
    """Bytes every HF block holds whatever its size (``memory_model.stage_overhead_bytes``); 0 for the GPT."""
    return 0.0 if hf is None else mm.stage_overhead_bytes(hf_arch(model, hf), hf_settings(model, train, hf))


def hf_arch(model: ModelConfig, hf: HFConfig) -> mm.Arch:
    """The checkpoint's own sizes; a path without a readable ``config.json`` is sized as a GPT-2 of the
    run's widths, so planning never fails on a config the peers will read themselves."""
    try:
        return mm.Arch.from_path(hf.path)
    except ValueError:
        gpt2 = {"n_embd": model.d_model, "n_head": model.n_heads, "n_layer": model.n_layers}
        return mm.Arch.from_config({"model_type": "gpt2", **gpt2, "vocab_size": model.vocab_size})


def wire_bytes(
    wire_forward: str, wire_backward: str, width: int, *, zstd: bool, tokens: int = 0, rank: int = DEFAULT_WIRE_RANK
) -> tuple[float, float]:
    """Bytes per element the planner sizes each direction with (``auto``: its ladder's smallest codec, for a
    model ``width`` wide whose 3- and 4-bit codes travel zstd-coded or not); plain sizes, before zstd.
    ``lowrank``'s depend on the micro-batch's ``tokens`` (rows) and the ``rank``: see :func:`lowrank_bytes`."""
    fwd = planned_codec(wire_forward, forward_ladder(width, zstd=zstd))
    bwd = planned_codec(wire_backward, backward_ladder(width, zstd=zstd))
    low = lowrank_bytes(tokens, width, rank)
    return (
        low if fwd == "lowrank" else CODEC_BYTES[fwd],
        low if bwd == "lowrank" else GRADIENT_CODEC_BYTES[bwd],
    )


def lowrank_bytes(tokens: int, width: int, rank: int) -> float:
    """Bytes per element of a ``tokens x width`` tensor sent ``lowrank``: ``(tokens + width) x rank`` int8 codes
    and an fp32 scale per 64 (``tokens`` unknown, 0: sized as a square matrix)."""
    rows = tokens or width
    r = min(rank, rows, width)
    return (rows + width) * r * (1 + 4 / 64) / (rows * width)


def boundary_elements(model: ModelConfig, train: TrainConfig, hf: HFConfig | None = None) -> float:
    """Values one micro-batch's activations (and gradients) hold across a boundary: tokens x width."""
    if hf is not None:
        return float(hf_settings(model, train, hf).tokens * hf_arch(model, hf).hidden)
    return float(train.micro_batch_size * model.context * model.d_model)


def hf_model_spec(
    arch: mm.Arch,
    settings: mm.Settings,
    wire_forward: str,
    wire_backward: str,
    *,
    zstd: bool,
    rank: int = DEFAULT_WIRE_RANK,
) -> ModelSpec:
    """Per-layer memory and cost of a checkpoint (embedding on layer 0, head and logits on the last; the last
    block keeps one micro-batch's activations, the others every one in flight)."""
    per_token = settings.tokens * arch.hidden
    n_b = arch.n_layers - 1
    fwd, bwd = wire_bytes(wire_forward, wire_backward, arch.hidden, zstd=zstd, tokens=settings.tokens, rank=rank)
    return ModelSpec(
        layer_cost=mm.layer_costs(arch, settings),
        layer_memory=mm.layer_memory(arch, settings),
        last_layer_memory=mm.last_layer_memory(arch, settings),
        forward_bytes=(per_token * fwd,) * n_b,
        backward_bytes=(per_token * bwd,) * n_b,
    )


def model_spec(model: ModelConfig, train: TrainConfig, hf: HFConfig | None = None) -> ModelSpec:
    """The built-in GPT: identical layers of 1 unit each, fp32 weights, gradients, AdamW and activations
    in flight (a rough count); a HF checkpoint: the memory model on its ``config.json``."""
    if hf is not None:
        arch = hf_arch(model, hf)
        settings = hf_settings(model, train, hf)
        return hf_model_spec(
            arch, settings, train.wire_forward, train.wire_backward, zstd=train.wire_zstd, rank=train.wire_rank
        )
    d, tokens = model.d_model, train.micro_batch_size * model.context
    params = 12 * d * d  # attention (4 d^2) + MLP (8 d^2) per layer
    weights = params * (4 + 4 + 8)  # fp32 weights, gradients, AdamW moments
    activations = tokens * d * ACTIVATION_TENSORS_PER_LAYER * 4 * train.in_flight_limit
    fwd, bwd = wire_bytes(
        train.wire_forward, train.wire_backward, d, zstd=train.wire_zstd, tokens=tokens, rank=train.wire_rank
    )
    return ModelSpec.uniform(
        model.n_layers,
        layer_memory=float(weights + activations),
        boundary_bytes=tokens * d * fwd,
        backward_bytes=tokens * d * bwd,
    )
