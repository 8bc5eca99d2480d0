"""Gradients that came back ahead of their step, held apart until the steps before theirs are taken.

Replicas of a later stage return gradients in the order they finish them, so a gradient of step t + 1 can
reach a stage before step t's last one. Summed into the live gradients, it made the stage step after any K
gradients, mixing two steps, and step t's last gradient then met two updates since its forward: under
S = 1 it was dropped (1-5% of the first stage's micro-batches with a replicated stage). Held here, each
step applies exactly its own micro-batches. It costs one more set of gradients per step held, and only
while gradients overtake (at most S sets: a stage has at most S + 1 steps in flight).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class HeldStep:
    """What one later step has gathered so far: its gradients, and its micro-batches through this stage."""

    grads: list[torch.Tensor | None]
    done: int = 0  # micro-batches through (applied or dropped)
    applied: int = 0
    late: int = 0  # versions late, summed over the applied, as of the update that will apply them


class StepGradients:
    """Per-step gradient buffers for the steps after the one the live ``.grad`` fields gather."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = params
        self._held: dict[int, HeldStep] = {}
        self.peak_bytes = 0  # the most bytes held at once: async's memory besides kept weights, in the summary

    def oldest(self) -> int | None:
        return min(self._held, default=None)

    def _at(self, step: int) -> HeldStep:
        return self._held.setdefault(step, HeldStep([None] * len(self._params)))

    def count(self, step: int, staleness: int | None) -> None:
        """A micro-batch of ``step`` is through: applied ``staleness`` versions late, or (None) dropped."""
        held = self._at(step)
        held.done += 1
        if staleness is not None:
            held.applied += 1
            held.late += staleness

    @contextmanager
    def gathering(self, step: int | None) -> Iterator[None]:
        """Back-propagate into ``step``'s buffer instead of the live gradients (swapped, not copied); None:
        into the live ones."""
        if step is None:
            yield
            return
        held = self._at(step)
        live = [p.grad for p in self._params]
        for p, g in zip(self._params, held.grads, strict=True):
            p.grad = g
        try:
            yield
        finally:
            held.grads = [p.grad for p in self._params]
            for p, g in zip(self._params, live, strict=True):
                p.grad = g
            self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def held_bytes(self) -> int:
        """Bytes of the gradient buffers held now."""
        return sum(g.numel() * g.element_size() for h in self._held.values() for g in h.grads if g is not None)

    def install(self, step: int) -> HeldStep:
        """Hand ``step``'s gradients to the live ``.grad`` fields (added where some are already there)."""
        held = self._held.pop(step)
        for p, g in zip(self._params, held.grads, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        held.grads = []
        return held

    def clear(self) -> None:
        self._held.clear()
