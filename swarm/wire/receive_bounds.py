"""What a stage may receive on its links, derived from its own assignment, checked before anything is allocated.

The wire's global limits (``swarm.wire.packets.DEFAULT_MAX_ELEMENTS`` = 2^27 elements, 512 MiB packets) are a
backstop for a peer that knows nothing yet. Once a stage has its block it knows exactly what its
neighbours may send: hidden states and gradients of at most ``(micro_batch_size, context, d_model)``,
targets of at most ``(micro_batch_size, context)``. Without these bounds a member could make a peer
buffer a 256 MiB packet, or decode a 64 MiB int4 payload into a 512 MiB tensor, before the stage's own
shape checks ran. The checks here are arithmetic on the header (``pb.Tensor.shape``), so a refusal
costs nothing; a refused tensor ends the sender's stream (``LimitExceeded`` is a ``WireError``).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config import ModelConfig, TrainConfig
from swarm.pb import wire_pb2 as pb
from swarm.security.limits import LimitExceeded, check_elements, stage_limits
from swarm.wire.packets import WireError


@dataclass(frozen=True)
class TensorBound:
    """A received tensor has exactly ``len(caps)`` dimensions, each at most its cap (exact where ``exact``)."""

    what: str
    caps: tuple[int, ...]
    exact: tuple[bool, ...]

    @property
    def max_elements(self) -> int:
        n = 1
        for c in self.caps:
            n *= c
        return n

    def check(self, msg: pb.Tensor) -> None:
        """Refuse ``msg`` unless its header fits; LimitExceeded / WireError name what is wrong."""
        shape = [int(d) for d in msg.shape]
        try:
            check_elements(shape, self.max_elements)  # also refuses negative dimensions and absurd ranks
        except LimitExceeded as e:
            fits = f"does not fit this stage's {list(self.caps)}"
            raise LimitExceeded(f"{self.what}: shape {shape} {fits}: {e}") from None
        if len(shape) != len(self.caps):
            raise WireError(f"{self.what}: shape {shape} must have {len(self.caps)} dimensions")
        for d, cap, exact in zip(shape, self.caps, self.exact, strict=True):
            if d > cap or (exact and d != cap):
                raise LimitExceeded(f"{self.what}: shape {shape} does not fit this stage's {list(self.caps)}")


@dataclass(frozen=True)
class LinkBounds:
    """Everything a stage accepts from its neighbours; see :func:`link_bounds`."""

    hidden: TensorBound
    targets: TensorBound
    gradients: TensorBound
    max_packet_bytes: int

    def check_packet(self, packet: pb.Packet) -> None:
        """Check every tensor of an incoming activations or gradients packet before it is decoded."""
        kind = packet.WhichOneof("body")
        if kind == "activations":
            self.hidden.check(packet.activations.hidden)
            if packet.activations.HasField("targets"):
                self.targets.check(packet.activations.targets)
        elif kind == "gradients" and packet.gradients.HasField("grad"):
            self.gradients.check(packet.gradients.grad)


def link_bounds(model: ModelConfig, train: TrainConfig) -> LinkBounds:
    """The bounds of a stage of ``model`` trained with ``train``: the same for every block of the run."""
    mb, ctx, d = train.micro_batch_size, model.context, model.d_model
    hidden = (mb, ctx, d)
    return LinkBounds(
        hidden=TensorBound("hidden states", hidden, (False, False, True)),
        targets=TensorBound("targets", (mb, ctx), (False, False)),
        gradients=TensorBound("gradient", hidden, (False, False, True)),
        max_packet_bytes=stage_limits(mb, ctx, d).max_packet_bytes,
    )
