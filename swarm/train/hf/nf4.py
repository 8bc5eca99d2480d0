"""4-bit NormalFloat (NF4) storage for the frozen base, as in QLoRA (Dettmers et al. 2023): a quarter of bf16.

Each row of an ``(out, in)`` matrix is cut into blocks of 64 values; a block keeps its absmax as fp32 and
every value as the index (4 bits) of the nearest of 16 NormalFloat code values, the quantiles of a
standard normal scaled to [-1, 1] with an exact zero (the table bitsandbytes and QLoRA publish). Two
indices share a byte, the first in the high nibble. Rows are padded with zeros to a multiple of 64, so a
row never shares a block with the next one: an embedding lookup dequantises only the rows it reads, and
odd shapes need no special case (the padding is stored, and counted by ``weight_bytes``).

QLoRA's double quantisation (the absmaxes themselves quantised to 8 bits in blocks of 256) is not done
here: storage is 0.5 + 4/64 = 0.5625 bytes per parameter (plus row padding), against QLoRA's 0.516
(whose absmaxes cost 0.127 bits per parameter instead of 0.5).

Like ``quant.Int8Linear``, a matmul dequantises straight to the activation dtype, and a custom autograd
function keeps only the packed weight for the backward. Pure torch ops, so CPU and CUDA alike; no
bitsandbytes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 64
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


DEQUANT_CHUNK = 1 << 20  # packed bytes per table lookup (4 MiB of int32 indices)


def _code(device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=dtype, device=device)


@functools.cache
def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 2): the two code values a packed byte stands for (high nibble first); built once per device and
    dtype, so a matmul on a GPU does not copy the table from the host each time."""
    with torch.inference_mode(False):  # a normal tensor even if first built under inference mode
        code = _code(device, dtype)
        b = torch.arange(256, device=device)
        return torch.stack([code[b >> 4], code[b & 15]], dim=1)


def padded_cols(cols: int) -> int:
    return -(-cols // BLOCK) * BLOCK


def quantize_nf4(weight: torch.Tensor, *, chunk_elements: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, absmax)`` of a 2-D float matrix: ``(rows, padded/2)`` uint8 and ``(rows, padded/64)`` fp32.

    ``padded`` is the column count rounded up to a multiple of 64. Works through the rows in chunks of
    about ``chunk_elements`` values, so the fp32 and index scratch stays a few MB for any matrix size, and
    never writes to ``weight`` (which may be a memory-mapped checkpoint tensor).
    """
    if not isinstance(weight, torch.Tensor) or weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"NF4 quantises a floating-point tensor, got {getattr(weight, 'dtype', type(weight))}")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"NF4 quantises a non-empty 2-D (rows, cols) matrix, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    cp = padded_cols(cols)
    packed = torch.empty((rows, cp // 2), dtype=torch.uint8, device=weight.device)
    absmax = torch.empty((rows, cp // BLOCK), dtype=torch.float32, device=weight.device)
    code = _code(weight.device)
    midpoints = (code[1:] + code[:-1]) / 2  # nearest code = bucket between midpoints
    step = max(1, chunk_elements // cp)
    for i in range(0, rows, step):
        src = weight[i : i + step].detach()
        n = src.shape[0]
        w = torch.zeros((n, cp), dtype=torch.float32, device=weight.device)  # scratch, padded with zeros
        w[:, :cols].copy_(src)
        blocks = w.view(n, cp // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=2)
        if not bool(torch.isfinite(amax).all()):
            raise ValueError("NF4 cannot quantise a matrix with inf or nan values")
        blocks.div_(torch.where(amax > 0, amax, torch.ones_like(amax))[..., None])
        idx = torch.bucketize(w, midpoints, out_int32=True).to(torch.uint8)
        packed[i : i + n] = (idx[:, 0::2] << 4) | idx[:, 1::2]
        absmax[i : i + n] = amax
    return packed, absmax


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``(..., cols)`` values in ``dtype`` from ``(..., padded/2)`` packed bytes and ``(..., padded/64)`` absmaxes.

    Goes straight to ``dtype`` (one table lookup by byte, one multiply), never through an fp32 copy.
    """
    if packed.dtype != torch.uint8 or absmax.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"expected uint8 packed codes and matching absmaxes, got {packed.dtype} {tuple(packed.shape)}")
    lead, half = packed.shape[:-1], packed.shape[-1]
    if half * 2 != absmax.shape[-1] * BLOCK or not 0 < cols <= half * 2:
        raise ValueError(f"packed {tuple(packed.shape)}, absmax {tuple(absmax.shape)} and {cols} columns disagree")
    table = _byte_table(packed.device, dtype)
    flat = packed.reshape(-1)
    values = torch.empty((flat.numel(), 2), dtype=dtype, device=packed.device)
    # The lookup's int32 indices would be as large as the output if made at once: a chunk at a time, so a
    # dequantised head costs one matrix in ``dtype`` plus a few MB, not two matrices.
    for i in range(0, flat.numel(), DEQUANT_CHUNK):
        torch.index_select(table, 0, flat[i : i + DEQUANT_CHUNK].to(torch.int32), out=values[i : i + DEQUANT_CHUNK])
    values = values.view(*lead, absmax.shape[-1], BLOCK).mul_(absmax.to(dtype)[..., None])
    return values.view(*lead, half * 2)[..., :cols]


class _NF4Matmul(torch.autograd.Function):
    """``x @ dequant(w).T + bias`` whose backward re-dequantises instead of saving the dequantised weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, bias: torch.Tensor | None, cols):
        ctx.save_for_backward(packed, absmax)
        ctx.cols = cols
        return F.linear(x, dequantize_nf4(packed, absmax, cols, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        packed, absmax = ctx.saved_tensors
        grad_x = grad @ dequantize_nf4(packed, absmax, ctx.cols, grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


class NF4Linear(nn.Module):
    """A frozen linear layer stored as packed NF4 codes + fp32 block absmaxes (buffers, never trained)."""

    def __init__(self, packed: torch.Tensor, absmax: torch.Tensor, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        if packed.dtype != torch.uint8 or packed.dim() != 2 or absmax.shape != (packed.shape[0], packed.shape[1] // 32):
            raise ValueError(
                f"expected (out, padded/2) uint8 codes and (out, padded/64) absmaxes, got "
                f"{packed.dtype} {tuple(packed.shape)} and {tuple(absmax.shape)}"
            )
        if not 0 < in_features <= packed.shape[1] * 2 or padded_cols(in_features) != packed.shape[1] * 2:
            raise ValueError(f"{in_features} input features do not fit codes of shape {tuple(packed.shape)}")
        self.out_features, self.in_features = packed.shape[0], in_features
        self.register_buffer("qweight", packed)
        self.register_buffer("absmax", absmax)
        self.register_buffer("bias", bias)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, *, dtype: torch.dtype, transposed: bool = False
    ) -> NF4Linear:
        """``transposed`` for GPT-2's Conv1D, which stores its weight as ``(in, out)``."""
        w = weight.t() if transposed else weight
        packed, absmax = quantize_nf4(w)
        return cls(packed, absmax, w.shape[1], None if bias is None else bias.detach().to(dtype))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nf4(self.qweight, self.absmax, self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            return _NF4Matmul.apply(x, self.qweight, self.absmax, bias, self.in_features)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"


class NF4Embedding(nn.Module):
    """A frozen embedding table stored as NF4 rows; a lookup dequantises only the rows it reads."""

    def __init__(self, packed: torch.Tensor, absmax: torch.Tensor, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        NF4Linear(packed, absmax, embedding_dim, None)  # the same shape checks
        self.num_embeddings, self.embedding_dim = packed.shape[0], embedding_dim
        self.dtype = dtype
        self.register_buffer("qweight", packed)
        self.register_buffer("absmax", absmax)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, *, dtype: torch.dtype) -> NF4Embedding:
        packed, absmax = quantize_nf4(weight)
        return cls(packed, absmax, weight.shape[1], dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_nf4(self.qweight[ids], self.absmax[ids], self.embedding_dim, self.dtype)

    def as_linear(self) -> NF4Linear:
        """The tied output head sharing this table's NF4 storage (a token's row is its output channel)."""
        return NF4Linear(self.qweight, self.absmax, self.embedding_dim, None)
