"""A block's state (weights and AdamW moments) as the receiver expects it, checked before it is decoded.

Both ends of a checkpoint receive whole block states: the coordinator from an uploading peer
(``coordinator/upload_checks.py`` builds the spec from the model), a peer from the coordinator when it
restores (the spec is its own block's). Either way every tensor must be one the receiver's block has,
with its shape (checked on the header, so nothing larger is ever decoded), float32 and finite, and the
packet no larger than that block's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarm.pb import control_pb2 as cpb
from swarm.pb import wire_pb2 as pb
from swarm.wire.packets import WireError, tensor_from_pb

MOMENTS = ("exp_avg", "exp_avg_sq")
PER_TENSOR_OVERHEAD = 1024  # name, header and protobuf framing of one tensor, generously


@dataclass(frozen=True)
class BlockSpec:
    """The trainable tensors of one block: global name -> shape (all float32)."""

    shapes: dict[str, tuple[int, ...]]

    @property
    def max_state_bytes(self) -> int:
        """Weights, two AdamW moments and a step counter per parameter, in fp32, plus framing."""
        elements = sum(math.prod(s) for s in self.shapes.values())
        return 3 * 4 * elements + 4 * len(self.shapes) * (4 + PER_TENSOR_OVERHEAD) + (64 << 10)


def _decode(t: pb.Tensor, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        x = tensor_from_pb(t, expect_shape=shape, expect_dtype=torch.float32, max_elements=max(math.prod(shape), 1))
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


def decode_state(chunk: cpb.StateChunk, spec: BlockSpec) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, optimizer state) of ``chunk``, or WireError naming the first thing that is not the block's."""
    weights: dict[str, torch.Tensor] = {}
    for t in chunk.tensors:
        if t.name in weights:
            raise WireError(f"parameter {t.name!r} twice in one upload")
        if t.name not in spec.shapes:
            raise WireError(f"parameter {t.name!r} is not part of this block")
        weights[t.name] = _decode(t.tensor, f"parameter {t.name}", spec.shapes[t.name])
    if set(weights) != set(spec.shapes):
        missing = sorted(set(spec.shapes) - set(weights))
        raise WireError(f"upload lacks {len(missing)} parameter(s) of its block, e.g. {missing[0]!r}")
    optim: dict[str, torch.Tensor] = {}
    for t in chunk.optimizer:
        if t.name in optim:
            raise WireError(f"optimizer state {t.name!r} twice in one upload")
        x = optim[t.name] = _decode(t.tensor, f"optimizer state {t.name}", _optimizer_shape(t.name, spec))
        if t.name.endswith("::exp_avg_sq") and bool((x < 0).any()):
            raise WireError(f"optimizer state {t.name} is negative")
    return weights, optim
