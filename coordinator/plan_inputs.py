"""Turn what peers announced and what the run trains into placement's inputs.

Placement (``coordinator/placement.py``) works on a cost model in seconds per micro-batch; this is where
Ravn's real numbers are mapped onto it: a peer's measured layer throughput (forward+backward of one layer
on one micro-batch), its memory, its link and whether it accepts connections, and per layer the memory
and the bytes each boundary carries per micro-batch after the wire codecs.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.cost_model import ModelSpec, PeerSpec
from swarm.config import HFConfig, ModelConfig, TrainConfig
from swarm.dht.schema import PeerRecord

# bytes per element on the wire, counting the fp16 scale of each 64-element block
CODEC_BYTES = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "int8": 1 + 2 / 64,
    "int4": 0.5 + 2 / 64,
    "int4_rot": 0.5 + 2 / 64,
}
ACTIVATION_TENSORS_PER_LAYER = 16  # saved tensors of one pre-norm block per token and channel, roughly
MIN_SPEED = 1e-3
MIN_BANDWIDTH = 1e3


def peer_specs(records: Sequence[PeerRecord]) -> list[PeerSpec]:
    """Measured claims as placement input; a peer that measured nothing still gets a tiny positive rate.

    The raw measurements go in: placement itself decides what is measurement noise (``placement.steady``).
    """
    return [
        PeerSpec(
            peer_id=r.peer_id,
            speed=max(r.throughput_layers_per_s, MIN_SPEED),
            free_memory=float(r.free_memory_bytes),
            upload=max(r.bandwidth_up_bytes_per_s, MIN_BANDWIDTH),
            download=max(r.bandwidth_down_bytes_per_s, MIN_BANDWIDTH),
            reachable=r.reachable is not False,
        )
        for r in records
    ]


def model_spec(model: ModelConfig, train: TrainConfig, hf: HFConfig | None = None) -> ModelSpec:
    """Identical layers: compute 1 unit each; memory for weights, optimizer and activations in flight."""
    d, tokens = model.d_model, train.micro_batch_size * model.context
    params = 12 * d * d  # attention (4 d^2) + MLP (8 d^2) per layer
    if hf is None:
        weights = params * (4 + 4 + 8)  # fp32 weights, gradients, AdamW moments
    else:
        per_param = {"int8": 1, "nf4": 0.5}.get(hf.quant, 4 if hf.dtype == "fp32" else 2)
        weights = params * per_param  # frozen base; adapters are tiny
    activations = tokens * d * ACTIVATION_TENSORS_PER_LAYER * 4 * train.in_flight_limit
    return ModelSpec.uniform(
        model.n_layers,
        layer_memory=float(weights + activations),
        boundary_bytes=tokens * d * CODEC_BYTES[train.wire_forward],
        backward_bytes=tokens * d * CODEC_BYTES[train.wire_backward],
    )
