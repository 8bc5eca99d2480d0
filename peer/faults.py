"""Deliberate faults for tests, apart from the settings a real peer runs with: a slow peer
(``--debug-slowdown``, ``--debug-slow-stage``), a peer that poisons what it sends (``--debug-poison``), or
one that dies between taking a checkpoint and uploading it (``--debug-crash-at-checkpoint``), or one that
announces a slow uplink it does not have (``--debug-uplink-mbit``: the planner's per-link codec choice
sees a home uplink on loopback).

A real component with one method overridden (as hivemind's tests inject a "faulty averager"): the
poisoned peer computes honestly, then scales by 1e6 or fills with NaN every training tensor it sends,
gradients upstream and activations downstream, once its block has taken ``after`` optimizer steps.
Eval micro-batches pass untouched, so only the sanity checks of its neighbours can catch it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.pb import wire_pb2 as pb
from swarm.wire.codec_policy import WirePolicy
from swarm.wire.codecs import DEFAULT_RANK
from swarm.wire.packets import tensor_to_pb

POISON_MODES = ("scale", "nan")
SCALE = 1e6


@dataclass(frozen=True)
class Faults:
    """The test knobs of one peer process (all off by default; never set in production)."""

    slowdown: float = 0.0  # extra seconds per training pass: an artificially slow peer
    slow_stage: tuple[int, float] | None = None  # whoever holds this stage is this much slower per pass
    poison: str = ""  # "scale" or "nan" corrupts every training tensor sent, after poison_after steps
    poison_after: int = 0
    crash_at_checkpoint: tuple[int, int] | None = None  # (stage, version) whose holder dies, see crash_due
    uplink_mbit: float = 0.0  # > 0: announce this upload bandwidth instead of the measured one

    def slow(self, stage: int) -> None:
        """Sleep as long as this peer is told to be slow at ``stage`` (compute thread, training passes only)."""
        if self.slowdown:
            time.sleep(self.slowdown)
        if self.slow_stage is not None and self.slow_stage[0] == stage:
            time.sleep(self.slow_stage[1])


@dataclass
class PoisonedPolicy(WirePolicy):
    mode: str = "scale"
    after: int = 0  # optimizer steps of this peer's block before the poisoning starts
    version: Callable[[], int] = lambda: 0

    def _active(self, mb: pb.MicroBatch) -> bool:
        return not mb.eval and self.version() >= self.after

    def _poison(self, t: torch.Tensor) -> pb.Tensor:
        bad = t.detach().float() * SCALE if self.mode == "scale" else torch.full_like(t.detach().float(), float("nan"))
        return tensor_to_pb(bad, "fp32", allow_nonfinite=True)

    def activations(self, mb: pb.MicroBatch, hidden: torch.Tensor, targets: torch.Tensor | None) -> pb.Packet:
        packet = super().activations(mb, hidden, targets)
        if self._active(mb) and hidden.is_floating_point():
            packet.activations.hidden.CopyFrom(self._poison(hidden))
        return packet

    def gradients(
        self, mb: pb.MicroBatch, grad: torch.Tensor | None, loss_sum: float = 0.0, tokens: int = 0, *, to: str
    ) -> pb.Packet:
        packet = super().gradients(mb, grad, loss_sum, tokens, to=to)
        if grad is not None and self._active(mb):
            packet.gradients.grad.CopyFrom(self._poison(grad))
        return packet


def crash_due(spec: tuple[int, int] | None, stage: int, first_assignment: bool, version: int) -> bool:
    """``--debug-crash-at-checkpoint STAGE=VERSION``: does the holder of STAGE die now, instead of uploading
    checkpoint VERSION? Only in the peer's first assignment, so that a survivor given that stage by the
    recovery replays the same version without dying too (a fault that strikes once, at a known moment)."""
    return spec is not None and first_assignment and spec == (stage, version)


def wire_policy(
    forward: str,
    backward: str,
    poison: str = "",
    after: int = 0,
    version: Callable[[], int] = lambda: 0,
    *,
    error_feedback: str = "off",
    backward_to: dict[str, str] | None = None,
    zstd: bool = False,
    rank: int = DEFAULT_RANK,
) -> WirePolicy:
    """The honest policy, or (testing only) one that poisons what it sends."""
    honest = {
        "forward": forward,
        "backward": backward,
        "error_feedback": error_feedback,
        "backward_to": dict(backward_to or {}),
        "zstd": zstd,
        "rank": rank,
    }
    if not poison:
        return WirePolicy(**honest)
    if poison not in POISON_MODES:
        raise ValueError(f"unknown poison mode {poison!r}; use one of {', '.join(POISON_MODES)}")
    return PoisonedPolicy(**honest, mode=poison, after=after, version=version)
