"""Which codec each direction uses, and how a stage turns results into packets.

Kept apart from the daemon so the conversion of a stage's tensors into wire packets (and back) is
one small, testable place, shared by every schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.pb import wire_pb2 as pb
from swarm.wire import DEFAULT_MAX_ELEMENTS, tensor_from_pb, tensor_to_pb


@dataclass(frozen=True)
class WirePolicy:
    forward: str = "fp32"
    backward: str = "fp32"
    max_elements: int = DEFAULT_MAX_ELEMENTS

    def activations(self, mb: pb.MicroBatch, hidden: torch.Tensor, targets: torch.Tensor | None) -> pb.Packet:
        codec = "raw" if not hidden.is_floating_point() else self.forward
        act = pb.Activations(mb=mb, hidden=tensor_to_pb(hidden, codec))
        if targets is not None:
            act.targets.CopyFrom(tensor_to_pb(targets.to(torch.int16 if targets.max() < 32768 else torch.int32), "raw"))
        return pb.Packet(activations=act)

    def gradients(
        self, mb: pb.MicroBatch, grad: torch.Tensor | None, loss_sum: float = 0.0, tokens: int = 0
    ) -> pb.Packet:
        msg = pb.Gradients(mb=mb, loss_sum=loss_sum, tokens=tokens)
        if grad is not None:
            msg.grad.CopyFrom(tensor_to_pb(grad, self.backward))
        return pb.Packet(gradients=msg)

    def decode(self, t: pb.Tensor) -> torch.Tensor:
        return tensor_from_pb(t, max_elements=self.max_elements)
