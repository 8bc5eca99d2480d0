"""What a block's upload (``Control.UploadState``) may contain, checked before anything is decoded or stored.

An upload names its block (``layer_start``/``layer_end``, or the stage of the end-of-run upload), and
the coordinator knows the model, so it knows every parameter's name and shape: an upload must carry
exactly those parameters, each with its shape, in float32, finite, with AdamW state only for them. The
packet itself may be no larger than the largest planned block needs. Without this a member could make
the coordinator buffer 8 GiB, decode 2^31 elements per tensor, or file NaN or misshapen weights as a
checkpoint. A Hugging Face block's trainable tensors are its LoRA adapters, whose names and shapes
follow from the checkpoint's config and the run's rank and targets: they are checked the same way.
"""

from __future__ import annotations

import functools

import torch

from swarm.config import HFConfig, ModelConfig
from swarm.pb import control_pb2 as cpb
from swarm.train.model import StageModel
from swarm.wire.packets import WireError
from swarm.wire.state_checks import BlockSpec


@functools.lru_cache(maxsize=64)
def gpt_block_spec(model: ModelConfig, start: int, end: int) -> BlockSpec:
    """Built on the meta device: shapes only, no memory, no initialisation cost."""
    if not 0 <= start < end <= model.n_layers:
        raise WireError(f"block [{start}, {end}) is outside the model's {model.n_layers} layers")
    with torch.device("meta"):
        block = StageModel(model, start, end)
    return BlockSpec({name: tuple(t.shape) for name, t in block.state_dict().items()})


@functools.lru_cache(maxsize=64)
def hf_block_spec(hf: HFConfig, start: int, end: int) -> BlockSpec:
    """The LoRA adapters of layers [start, end) under their global HF names, as ``HFStageModel`` names them.

    Each layer is built on the meta device (no weights are read), and every projection ``attach_lora``
    would wrap contributes ``lora_A`` (rank, in) and ``lora_B`` (out, rank)."""
    from swarm.train.hf.arch import architecture_for
    from swarm.train.hf.loader import CheckpointReader, load_hf_config
    from swarm.train.hf.lora import linear_features

    arch = architecture_for(load_hf_config(hf.path), set(CheckpointReader(hf.path).files))
    if not 0 <= start < end <= arch.n_layers:
        raise WireError(f"block [{start}, {end}) is outside the model's {arch.n_layers} layers")
    targets = set(hf.lora_targets or arch.lora_targets)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(start, end):
        with torch.device("meta"):
            layer = arch.new_layer(i)
        for name, child in layer.named_modules():
            features = linear_features(child) if name and name.rsplit(".", 1)[-1] in targets else None
            if features is not None:
                prefix = f"{arch.layer_tensor_prefix(i)}{name}"
                shapes[f"{prefix}.lora_A.weight"] = (hf.lora_rank, features[0])
                shapes[f"{prefix}.lora_B.weight"] = (features[1], hf.lora_rank)
    return BlockSpec(shapes)


def spec_for(model: ModelConfig, hf: HFConfig | None, start: int, end: int) -> BlockSpec:
    return hf_block_spec(hf, start, end) if hf is not None else gpt_block_spec(model, start, end)


def max_upload_bytes(model: ModelConfig, hf: HFConfig | None, blocks: list[tuple[int, int]]) -> int:
    """The largest upload any planned block may send (the Reassembler's cap, checked at the first frame)."""
    if not blocks:
        return 64 << 10  # nothing is planned: no upload can be one of ours
    return max(spec_for(model, hf, a, b).max_state_bytes for a, b in blocks)


def block_spec(
    model: ModelConfig, hf: HFConfig | None, chunk: cpb.StateChunk, planned: tuple[int, int] | None
) -> BlockSpec:
    """The spec of the block ``chunk`` is for: its own layer range (a checkpoint), else the uploader's
    planned block (the end-of-run upload)."""
    if chunk.periodic:
        return spec_for(model, hf, chunk.layer_start, chunk.layer_end)
    if planned is None:
        raise WireError(f"peer {chunk.peer_id!r} holds no block in the plan")
    return spec_for(model, hf, *planned)
