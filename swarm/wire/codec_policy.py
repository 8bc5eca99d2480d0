"""Which codec each direction uses, and how a stage turns results into packets.

Kept apart from the daemon so the conversion of a stage's tensors into wire packets (and back) is
one small, testable place, shared by every schedule. Gradients sent with a lossy codec can go through
error feedback, so what quantisation drops from one micro-batch's gradient is sent with the next
instead of being lost; under ``auto`` only where the link's codec is one whose feedback was measured to pay
(``FEEDBACK_AUTO_CODECS``), decided per link because a per-link ``auto`` wire picks each link's codec.
The residual is what one receiver is still owed, so there is one per destination peer: with replicated
upstream holders, each holder's stream telescopes on its own.

The codec of each link is the plan's (``--wire-* auto`` picks one per link, coordinator/wire_choice.py):
activations go out with ``forward`` (encoded before the sender routes them to a holder, so one codec for
all its downstream links), gradients with ``backward_to[destination]``, or ``backward`` where the plan
names none. ``sent`` counts tensors by direction and codec: what a stage reports as actually sent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from swarm.pb import wire_pb2 as pb
from swarm.wire import codecs, ecsq
from swarm.wire.codecs import DEFAULT_BLOCK_SIZE, DEFAULT_RANK, LOSSY_CODECS, encode
from swarm.wire.error_feedback import ErrorFeedback
from swarm.wire.packets import DEFAULT_MAX_ELEMENTS, WireError, encoded_to_pb, tensor_from_pb, tensor_to_pb
from swarm.wire.quantize import num_blocks
from swarm.wire.sample_deltas import DeltaSender

LOSSY = frozenset(LOSSY_CODECS)
FEEDBACK_MODES = ("auto", "on", "off")
# Gradient codecs whose error feedback pays: at the default recipe it took int3_rot's loss cost on
# gpt-medium from +3.2% to +2.0%; on int8 and int4_rot gradients it gained nothing (docs/BENCHMARKS.md).
# lowrank drops the same small directions of every gradient, the bias it exists for; measured only with it,
# where lowrank gradients still cost +2.35% (docs/codecs.md, "Low rank": send gradients int3_rot).
# ecsq rounds the same small values to 0 on every gradient, int3_rot's bias and more (docs/codecs.md, "ecsq").
FEEDBACK_AUTO_CODECS = frozenset({"int3_rot", "lowrank", "ecsq"})


def feeds_back(mode: str, codec: str) -> bool:
    """Whether gradients sent with ``codec`` carry its rounding error on, under ``--error-feedback-backward``."""
    return codec in LOSSY and (mode == "on" or (mode == "auto" and codec in FEEDBACK_AUTO_CODECS))


@dataclass
class WirePolicy:
    forward: str = "fp32"
    backward: str = "fp32"
    error_feedback: str = "off"  # a FEEDBACK_MODES entry (``--error-feedback-backward``), applied per link
    zstd: bool = False  # 4-bit payloads travel zstd-coded, losslessly (``--wire-zstd``, swarm/wire/entropy.py)
    block_size: int = DEFAULT_BLOCK_SIZE
    rank: int = DEFAULT_RANK  # the lowrank codec's (``--wire-rank``)
    max_elements: int = DEFAULT_MAX_ELEMENTS
    backward_to: dict[str, str] = field(default_factory=dict)  # upstream holder -> codec of gradients to it
    sent: Counter[str] = field(default_factory=Counter)  # "forward:<codec>" / "backward:<codec>" -> tensors
    _feedback: dict[str, ErrorFeedback] = field(default_factory=dict)  # destination peer id -> its residual
    _small: dict[str, bool] = field(default_factory=dict)  # destination -> its last gradient had fp32 scales

    def _options(self, codec: str, mb: pb.MicroBatch) -> dict:
        if codec not in LOSSY or codec == "ecsq":  # ecsq has no blocks, seed or rank
            return {}
        return {"block_size": self.block_size, "seed": mb.id, **({"rank": self.rank} if codec == "lowrank" else {})}

    def activations(
        self,
        mb: pb.MicroBatch,
        hidden: torch.Tensor,
        targets: torch.Tensor | None,
        deltas: DeltaSender | None = None,
        delta_codec: str = "",
    ) -> pb.Packet:
        """The packet of ``hidden``; with ``deltas`` (one link's), as the change since its samples' last visit,
        sent ``delta_codec``, where that link holds them (swarm/wire/sample_deltas.py)."""
        cache = pb.CACHE_NONE
        if not hidden.is_floating_point():
            tensor = tensor_to_pb(hidden, "raw")
        elif deltas is not None and mb.samples and not mb.eval:

            def encode_rows(x: torch.Tensor, changed: torch.Tensor | None) -> codecs.EncodedTensor:
                codec = delta_codec if changed is not None else self.forward
                self.sent[f"forward:{codec}" if changed is None else f"forward:delta:{codec}"] += 1
                if changed is not None and codec == "ecsq":  # its step follows the activation, not the change
                    return codecs.encode(x, codec, reference_rms=ecsq.rms(changed.reshape(-1)))
                return codecs.encode(x, codec, **self._options(codec, mb))

            try:
                cache, enc = deltas.encode(list(mb.samples), hidden, encode_rows)
            except codecs.CodecError as e:
                raise WireError(str(e)) from e
            tensor = encoded_to_pb(enc, zstd=self.zstd)
        else:
            tensor = tensor_to_pb(hidden, self.forward, zstd=self.zstd, **self._options(self.forward, mb))
            self.sent[f"forward:{self.forward}"] += 1
        act = pb.Activations(mb=mb, hidden=tensor, cache=cache)
        if targets is not None:
            small = targets.to(torch.int16 if int(targets.max()) < 32768 else torch.int32)
            act.targets.CopyFrom(tensor_to_pb(small, "raw"))
        return pb.Packet(activations=act)

    def gradients(
        self, mb: pb.MicroBatch, grad: torch.Tensor | None, loss_sum: float = 0.0, tokens: int = 0, *, to: str
    ) -> pb.Packet:
        """The packet carrying ``grad`` back to peer ``to``, whose residual (and only its) rides along."""
        msg = pb.Gradients(mb=mb, loss_sum=loss_sum, tokens=tokens)
        if grad is not None:
            codec = self.codec_to(to)
            options = self._options(codec, mb)
            if options:  # quantise once: fp32 scales first while this link's last gradient needed them
                options["small"] = self._small.get(to, True)  # gradients w.r.t. hidden states are ~1e-7
            try:
                if feeds_back(self.error_feedback, codec):
                    enc = self._feedback.setdefault(to, ErrorFeedback()).encode(grad, codec, **options)
                else:
                    enc = encode(grad, codec, **options)
            except ValueError as e:  # CodecError, or error feedback's own refusal
                raise WireError(str(e)) from e
            msg.grad.CopyFrom(encoded_to_pb(enc, zstd=self.zstd))
            if options:  # from the scales as quantised: on the wire they may be zstd-coded, and shorter
                self._small[to] = len(enc.scales) == 4 * num_blocks(grad.numel(), self.block_size)
            self.sent[f"backward:{codec}"] += 1
        return pb.Packet(gradients=msg)

    def codec_to(self, to: str) -> str:
        """The codec of gradients sent to upstream holder ``to``: its link's, else the run's."""
        return self.backward_to.get(to, self.backward)

    def feedback_text(self) -> str:
        """Error feedback as the logs show it: ``on``/``off``, or per upstream holder where links differ."""
        links = {to: feeds_back(self.error_feedback, codec) for to, codec in sorted(self.backward_to.items())}
        states = set(links.values()) or {feeds_back(self.error_feedback, self.backward)}
        if len(states) == 1:
            return "on" if states.pop() else "off"
        return ", ".join(f"{'on' if on else 'off'} to {to}" for to, on in links.items())

    def decode(self, t: pb.Tensor) -> torch.Tensor:
        return tensor_from_pb(t, max_elements=self.max_elements)
