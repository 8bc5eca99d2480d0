"""What a block's upload (``Control.UploadState``) may contain, checked before anything is decoded or stored.

An upload names its block (``layer_start``/``layer_end``, or the stage of the end-of-run upload), and
the coordinator knows the model, so it knows every parameter's name and shape: an upload must carry
exactly those parameters, each with its shape, in float32, finite, with AdamW state only for them. The
packet itself may be no larger than the largest planned block needs. Without this a member could make
the coordinator buffer 8 GiB, decode 2^31 elements per tensor, or file NaN or misshapen weights as a
checkpoint. Built-in GPT blocks are checked name by name; for a Hugging Face block (whose trainable
tensors only its peers' checkpoint defines) the tensors are checked for finiteness and dtype only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from swarm.config import HFConfig, ModelConfig
from swarm.model import StageModel
from swarm.pb import control_pb2 as cpb
from swarm.pb import wire_pb2 as pb
from swarm.wire import WireError, tensor_from_pb

MAX_HF_STATE_BYTES = 8 << 30  # a Hugging Face block: no spec here, the old global bound
MAX_HF_ELEMENTS = 1 << 31
MOMENTS = ("exp_avg", "exp_avg_sq")
PER_TENSOR_OVERHEAD = 1024  # name, header and protobuf framing of one tensor, generously


@dataclass(frozen=True)
class BlockSpec:
    """The trainable tensors of one block: global name -> shape (all float32)."""

    shapes: dict[str, tuple[int, ...]]

    @property
    def max_upload_bytes(self) -> int:
        """Weights, two AdamW moments and a step counter per parameter, in fp32, plus framing."""
        elements = sum(math.prod(s) for s in self.shapes.values())
        return 3 * 4 * elements + 4 * len(self.shapes) * (4 + PER_TENSOR_OVERHEAD) + (64 << 10)


@functools.lru_cache(maxsize=64)
def gpt_block_spec(model: ModelConfig, start: int, end: int) -> BlockSpec:
    """Built on the meta device: shapes only, no memory, no initialisation cost."""
    if not 0 <= start < end <= model.n_layers:
        raise WireError(f"block [{start}, {end}) is outside the model's {model.n_layers} layers")
    with torch.device("meta"):
        block = StageModel(model, start, end)
    return BlockSpec({name: tuple(t.shape) for name, t in block.state_dict().items()})


def max_upload_bytes(model: ModelConfig, hf: HFConfig | None, blocks: list[tuple[int, int]]) -> int:
    """The largest upload any planned block may send (the Reassembler's cap, checked at the first frame)."""
    if hf is not None or not blocks:
        return MAX_HF_STATE_BYTES
    return max(gpt_block_spec(model, a, b).max_upload_bytes for a, b in blocks)


def _decode(t: pb.Tensor, what: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    bound = {"max_elements": MAX_HF_ELEMENTS} if shape is None else {"max_elements": max(math.prod(shape), 1)}
    try:
        x = tensor_from_pb(t, expect_shape=shape, expect_dtype=torch.float32, **bound)
    except WireError as e:
        raise WireError(f"{what}: {e}") from None
    if not bool(torch.isfinite(x).all()):
        raise WireError(f"{what} contains NaN or Inf")
    return x


def _optimizer_shape(name: str, spec: BlockSpec) -> tuple[int, ...]:
    base, _, kind = name.rpartition("::")
    if base not in spec.shapes or kind not in (*MOMENTS, "step"):
        raise WireError(f"optimizer state {name!r} does not belong to a parameter of this block")
    return () if kind == "step" else spec.shapes[base]


def decode_upload(
    chunk: cpb.StateChunk, spec: BlockSpec | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, optimizer state) of ``chunk``, or WireError naming the first thing that is not the block's."""
    weights: dict[str, torch.Tensor] = {}
    for t in chunk.tensors:
        if t.name in weights:
            raise WireError(f"parameter {t.name!r} twice in one upload")
        if spec is not None and t.name not in spec.shapes:
            raise WireError(f"parameter {t.name!r} is not part of this block")
        weights[t.name] = _decode(t.tensor, f"parameter {t.name}", None if spec is None else spec.shapes[t.name])
    if spec is not None and set(weights) != set(spec.shapes):
        missing = sorted(set(spec.shapes) - set(weights))
        raise WireError(f"upload lacks {len(missing)} parameter(s) of its block, e.g. {missing[0]!r}")
    optim: dict[str, torch.Tensor] = {}
    for t in chunk.optimizer:
        if t.name in optim:
            raise WireError(f"optimizer state {t.name!r} twice in one upload")
        shape = None if spec is None else _optimizer_shape(t.name, spec)
        x = optim[t.name] = _decode(t.tensor, f"optimizer state {t.name}", shape)
        if t.name.endswith("::exp_avg_sq") and bool((x < 0).any()):
            raise WireError(f"optimizer state {t.name} is negative")
    return weights, optim


def block_spec(
    model: ModelConfig, hf: HFConfig | None, chunk: cpb.StateChunk, planned: tuple[int, int] | None
) -> BlockSpec | None:
    """The spec of the block ``chunk`` is for: its own layer range (a checkpoint), else the uploader's
    planned block (the end-of-run upload). None for a Hugging Face block."""
    if hf is not None:
        return None
    if chunk.periodic:
        return gpt_block_spec(model, chunk.layer_start, chunk.layer_end)
    if planned is None:
        raise WireError(f"peer {chunk.peer_id!r} holds no block in the plan")
    return gpt_block_spec(model, *planned)
