"""Int8 weight-only storage for the frozen base: half the memory of bf16, dequantised per matmul.

A volunteer's GPU holds a block of a model whose weights never change during LoRA fine-tuning, so they
can live as int8 with one absmax scale per output channel (row of the ``(out, in)`` matrix). Each
matmul dequantises its weight to the activation dtype just in time; a custom autograd function keeps
only the int8 weight for the backward pass, so in-flight micro-batches do not pin dequantised copies of
every weight. Activations, norms and the trainable adapters stay in floating point.

This is also the one place that maps a ``quant`` name to its storage: ``int8`` here, ``nf4`` in ``nf4.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swarm.train.hf.nf4 import NF4Embedding, NF4Linear

INT8_MAX = 127.0


def quantize_absmax(weight: torch.Tensor, *, chunk_elements: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``weight[i] ≈ q[i] * scale[i]``; rows of zeros get scale 1 (exact).

    Works through the rows in chunks so that quantising a 32k x 4k embedding needs a few MB of fp32
    scratch, not several fp32 copies of the whole matrix.
    """
    rows, cols = weight.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, dtype=torch.float32, device=weight.device)
    step = max(1, chunk_elements // max(cols, 1))
    for i in range(0, rows, step):
        w = weight[i : i + step].detach().to(torch.float32, copy=True)  # scratch: divided in place below
        absmax = w.abs().amax(dim=1)
        s = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
        q[i : i + step] = w.div_(s[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        scale[i : i + step] = s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Straight to the compute dtype (int8 values are exact in bf16/fp16), so no fp32 copy of a big matrix."""
    return q.to(dtype).mul_(scale.to(dtype)[:, None])  # in place: one matrix-sized temporary, not two


class _Int8Matmul(torch.autograd.Function):
    """``x @ dequant(q).T + bias`` whose backward re-dequantises instead of saving the fp weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(q, scale)
        return F.linear(x, dequantize(q, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, scale = ctx.saved_tensors
        grad_x = grad @ dequantize(q, scale, grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class Int8Linear(nn.Module):
    """A frozen linear layer stored as int8 + per-output-channel fp32 scales (buffers, never trained)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"expected an (out, in) int8 matrix and (out,) scales, got {q.dtype} {tuple(q.shape)}")
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, *, dtype: torch.dtype, transposed: bool = False
    ) -> Int8Linear:
        """``transposed`` for GPT-2's Conv1D, which stores its weight as ``(in, out)``."""
        q, scale = quantize_absmax(weight.t() if transposed else weight)
        return cls(q, scale, None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            return _Int8Matmul.apply(x, self.qweight, self.scale, bias)
        return F.linear(x, dequantize(self.qweight, self.scale, x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Embedding(nn.Module):
    """A frozen embedding table stored as int8 rows (one scale per token); only looked-up rows are dequantised."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.dtype = dtype
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, *, dtype: torch.dtype) -> Int8Embedding:
        q, scale = quantize_absmax(weight)
        return cls(q, scale, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.qweight[ids].to(torch.float32) * self.scale[ids][..., None]).to(self.dtype)

    def as_linear(self) -> Int8Linear:
        """The tied output head sharing this table's int8 storage (a token's row is its output channel)."""
        return Int8Linear(self.qweight, self.scale, None)


QUANTIZED_LINEARS = (Int8Linear, NF4Linear)
QUANTIZED_EMBEDDINGS = (Int8Embedding, NF4Embedding)
_KINDS = {"int8": (Int8Linear, Int8Embedding), "nf4": (NF4Linear, NF4Embedding)}


def _kind(quant: str) -> tuple[type, type]:
    if quant not in _KINDS:
        raise ValueError(f"unknown base quantisation {quant!r}; choose {', '.join(_KINDS)} (or none)")
    return _KINDS[quant]


def quantized_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, *, quant: str, dtype: torch.dtype, transposed: bool = False
) -> nn.Module:
    """An ``Int8Linear`` or ``NF4Linear`` (``quant``) of an ``(out, in)`` weight, or ``(in, out)`` if ``transposed``."""
    return _kind(quant)[0].from_weight(weight, bias, dtype=dtype, transposed=transposed)


def quantized_embedding(weight: torch.Tensor, *, quant: str, dtype: torch.dtype) -> nn.Module:
    return _kind(quant)[1].from_weight(weight, dtype=dtype)


def quantize_linears(
    module: nn.Module, *, quant: str, dtype: torch.dtype, device: torch.device, raw: dict | None = None
) -> list[str]:
    """Swap every linear (and GPT-2 ``Conv1D``) of ``module`` for its ``quant`` form on ``device``; their names.

    Weights come from ``raw`` (the checkpoint's tensors by name, popped: quantised from the stored, not the
    down-cast, values) when given, else from the module itself.
    """
    from transformers.pytorch_utils import Conv1D

    names = []
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.Linear | Conv1D):
            if raw is not None:
                weight, bias = raw.pop(f"{name}.weight"), raw.pop(f"{name}.bias", None)
            else:
                weight, bias = child.weight, child.bias
            q = quantized_linear(weight, bias, quant=quant, dtype=dtype, transposed=isinstance(child, Conv1D))
            module.set_submodule(name, q.to(device))
            names.append(name)
            del weight, bias  # the stored copies go before the next read: one tensor in flight, not two
    return names


def tensor_bytes(module: nn.Module, *, exclude: tuple[str, ...] = ()) -> int:
    """Bytes held by a module's parameters and persistent buffers, skipping names containing any of ``exclude``."""
    total, seen = 0, set()
    for name, t in module.state_dict(keep_vars=True).items():
        if any(e in name for e in exclude) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
