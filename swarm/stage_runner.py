"""The compute of one pipeline stage: forward, backward and optimizer, with no network in sight.

A peer daemon feeds it micro-batches as they arrive and ships what it returns. Keeping this free of
gRPC means the exact same object runs in tests, in benchmarks and behind the wire, and the daemon
stays a thin shell. It is not thread-safe: the daemon calls it from one compute thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from swarm.config import ModelConfig, TrainConfig
from swarm.model import StageModel


class StageInputError(ValueError):
    """A micro-batch that this stage cannot accept (wrong shape, unknown id, non-finite values)."""


@dataclass
class ForwardResult:
    output: torch.Tensor | None = None       # hidden states to send downstream (non-last stages)
    input_grad: torch.Tensor | None = None   # last stage: gradient to send upstream right away
    loss_sum: float = 0.0                    # last stage: summed token loss of this micro-batch
    tokens: int = 0
    stepped: bool = False


@dataclass
class StageMetrics:
    forward: int = 0
    backward: int = 0
    compute_seconds: float = 0.0
    staleness: dict[int, int] = field(default_factory=dict)


class StageRunner:
    """Holds one block's parameters and optimizer state; steps every ``micro_batches`` backwards."""

    def __init__(
        self, model_cfg: ModelConfig, train_cfg: TrainConfig, start: int, end: int, device: str = "cpu"
    ) -> None:
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.device = torch.device(device)
        self.model = StageModel(model_cfg, start, end).to(self.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train_cfg.lr, betas=(0.9, 0.95), weight_decay=train_cfg.weight_decay
        )
        self.version = 0
        self.metrics = StageMetrics()
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._backwards = 0
        self._tokens_per_step = train_cfg.micro_batches * train_cfg.micro_batch_size * model_cfg.context

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def expected_input(self, batch: int, time_: int) -> tuple[tuple[int, ...], torch.dtype]:
        if self.is_first:
            return (batch, time_), torch.int64
        return (batch, time_, self.model_cfg.d_model), torch.float32

    def _check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        if x.dim() < 2 or x.shape[1] > self.model_cfg.context or x.shape[0] == 0:
            raise StageInputError(f"input of shape {list(x.shape)} is not (batch, time <= {self.model_cfg.context})")
        shape, dtype = self.expected_input(x.shape[0], x.shape[1])
        if tuple(x.shape) != shape:
            raise StageInputError(f"input shape {list(x.shape)} does not match the expected {list(shape)}")
        if self.is_first:
            if x.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                raise StageInputError(f"first stage expects integer token ids, got {x.dtype}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.model_cfg.vocab_size):
                raise StageInputError(f"token ids outside [0, {self.model_cfg.vocab_size})")
        elif not x.is_floating_point():
            raise StageInputError(f"hidden states must be floating point, got {x.dtype}")
        elif not bool(torch.isfinite(x).all()):
            raise StageInputError("hidden states contain NaN or Inf")
        if self.is_last:
            if targets is None:
                raise StageInputError("the last stage needs targets with every micro-batch")
            if tuple(targets.shape) != tuple(x.shape[:2]):
                raise StageInputError(f"targets shape {list(targets.shape)} does not match {list(x.shape[:2])}")
            if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= self.model_cfg.vocab_size):
                raise StageInputError(f"target ids outside [0, {self.model_cfg.vocab_size})")

    def forward(
        self, mb_id: int, x: torch.Tensor, targets: torch.Tensor | None = None, *, train: bool = True
    ) -> ForwardResult:
        """Run this block on one micro-batch; the last stage also computes the loss (and its backward)."""
        self._check_input(x, targets)
        if train and mb_id in self._pending:
            raise StageInputError(f"micro-batch {mb_id} is already in flight on this stage")
        t0 = time.perf_counter()
        x = x.to(self.device)
        if self.is_first:
            x = x.long()
        else:
            x = x.float()
        try:
            if not train:
                with torch.no_grad():
                    out = self.model(x)
                    if self.is_last:
                        loss = self.model.loss_sum(out, targets.to(self.device).long())
                        return ForwardResult(loss_sum=float(loss), tokens=targets.numel())
                    return ForwardResult(output=out)
            x_in = x if self.is_first else x.detach().requires_grad_(True)
            out = self.model(x_in)
            self.metrics.forward += 1
            if not self.is_last:
                self._pending[mb_id] = (x_in, out, self.version)
                return ForwardResult(output=out.detach())
            loss = self.model.loss_sum(out, targets.to(self.device).long())
            (loss / self._tokens_per_step).backward()
            result = ForwardResult(
                input_grad=None if self.is_first else x_in.grad,
                loss_sum=float(loss.detach()),
                tokens=targets.numel(),
            )
            result.stepped = self._after_backward(self.version)
            return result
        finally:
            self.metrics.compute_seconds += time.perf_counter() - t0

    def backward(self, mb_id: int, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """Back-propagate the gradient of this stage's output; returns (input gradient, stepped)."""
        if mb_id not in self._pending:
            raise StageInputError(f"gradient for micro-batch {mb_id}, which is not in flight on this stage")
        x_in, out, version = self._pending[mb_id]
        if tuple(grad_output.shape) != tuple(out.shape):
            raise StageInputError(f"gradient shape {list(grad_output.shape)} does not match output {list(out.shape)}")
        if not grad_output.is_floating_point() or not bool(torch.isfinite(grad_output).all()):
            raise StageInputError("gradient is not a finite floating-point tensor")
        del self._pending[mb_id]
        t0 = time.perf_counter()
        out.backward(grad_output.to(device=self.device, dtype=out.dtype))
        self.metrics.backward += 1
        stepped = self._after_backward(version)
        self.metrics.compute_seconds += time.perf_counter() - t0
        return (None if self.is_first else x_in.grad), stepped

    def drop(self, mb_id: int) -> bool:
        """Forget an in-flight micro-batch whose gradient will never come."""
        return self._pending.pop(mb_id, None) is not None

    def _after_backward(self, forward_version: int) -> bool:
        staleness = self.version - forward_version
        self.metrics.staleness[staleness] = self.metrics.staleness.get(staleness, 0) + 1
        self._backwards += 1
        if self._backwards >= self.train_cfg.micro_batches:
            self.step()
            return True
        return False

    def step(self) -> None:
        """Apply the accumulated gradients; the weight version counts these steps."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.train_cfg.lr_at(self.version)
        if self.train_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self._backwards = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
