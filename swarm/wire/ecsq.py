"""Entropy-coded scalar quantisation (``ecsq``): one step for the whole tensor, int8 codes, entropy-coded.

Why: the block codecs (``int3_rot``) give every block of 64 values the same levels whatever its magnitude,
so a block of tiny values costs as many bits as one of large values, and each block's scale travels too.
Gradients w.r.t. hidden states vary by orders of magnitude from token to token, and the weight gradients
they sum into count an error in absolute terms, wherever it falls. A uniform quantiser with one step for
the whole tensor whose codes are entropy-coded is the classic answer for squared error at a given rate
(Gish and Pierce, 1968): small values cost few bits because their codes are mostly 0, and no per-block
scale travels. On gpt-medium's gradients after 300 steps it sends ~20% fewer bytes than ``int3_rot`` at the
same relative error per message; in training, with the error feedback it needs (without it a small token's
gradient rounds to 0 every time), it cost less loss than int3_rot's gradients, at the same bytes zstd-coded
and 23% fewer entropy-coded by rows (docs/codecs.md, "ecsq" and "Row-coded ecsq"). On activations, whose
rows have similar magnitudes, it gains nothing.

Layout: ``q = round(x / step)`` as int8 (two's complement), one byte per value, C order; the codec's
``scales`` are ``step`` as one little-endian fp32, ``step = max(STEP_PER_RMS * rms(x), absmax(x) / 127)``,
so no code is clamped and every value decodes within ``step / 2`` of what was sent. ``STEP_PER_RMS`` gives
the relative error ``int3_rot`` has on Gaussian data (0.25): the same precision where both fit the data.
The codes are meant to travel entropy-coded by rows (``swarm.wire.row_coding``; plain they are int8's size).

On CPU a tensor larger than ``CPU_CHUNK_ELEMS`` is streamed through in chunks, as ``swarm.wire.quantize`` does, so
the temporaries stay in cache: encode and decode are elementwise, so the codes and values are the same to the
bit; only the rms's float64 sum of squares runs chunk by chunk in another order (a tensor of one chunk or less,
such as gpt-medium's 512 x 256 boundary, takes the one-pass path). 64 MiB on one core: ~2x faster.

Nothing here validates input: ``swarm.wire.codecs`` does that before calling in.
"""

from __future__ import annotations

import math

import torch

from swarm.wire.quantize import CPU_CHUNK_ELEMS

STEP_PER_RMS = 0.87  # step / rms(x): relative error 0.25 on Gaussian data, int3_rot's there
# A change to an activation (--wire-forward-delta ecsq) is quantised at the step int4_rot gives the activation
# itself on Gaussian data (absmax of a block of 64 ~ 2.4 rms, over 7 levels): its error is never worse than
# int4_rot's, and a small change costs few bits since most of its codes are 0 (swarm/wire/sample_deltas.py).
STEP_PER_REFERENCE_RMS = 0.34
LEVEL = 127  # the largest |code| the encoder writes (a decoder accepts any int8)
MIN_STEP = torch.finfo(torch.float32).tiny  # a tensor of subnormal values decodes to zeros, within step / 2
MAX_STEP = torch.finfo(torch.float32).max / 128  # any int8 code times the step stays finite


def step_of(flat: torch.Tensor, absmax: float, reference_rms: float | None = None) -> float:
    """The quantisation step of a finite, flat float tensor whose largest magnitude is ``absmax`` (0 for an
    empty or all-zero one): from its own rms, or from ``reference_rms``, that of the tensor it changes."""
    if not flat.numel() or absmax == 0.0:
        return 0.0
    if reference_rms is None:
        step = STEP_PER_RMS * rms(flat)
    else:
        step = STEP_PER_REFERENCE_RMS * reference_rms
    step = max(step, absmax / LEVEL, MIN_STEP)
    return float(torch.tensor(step, dtype=torch.float32))  # what travels (a code moves by < 1e-6 at most)


def rms(flat: torch.Tensor) -> float:
    """Root mean square of a flat float tensor (0 for an empty one), summed in float64."""
    return math.sqrt(_sum_of_squares(flat) / flat.numel()) if flat.numel() else 0.0


def _sum_of_squares(flat: torch.Tensor) -> float:
    if not flat.is_cpu or flat.numel() <= CPU_CHUNK_ELEMS:
        return float(torch.linalg.vector_norm(flat, dtype=torch.float64)) ** 2
    buf = torch.empty(CPU_CHUNK_ELEMS, dtype=torch.float64)
    total = 0.0
    for chunk in flat.split(CPU_CHUNK_ELEMS):
        b = buf[: chunk.numel()].copy_(chunk)
        total += float(torch.dot(b, b))
    return total


def encode(flat: torch.Tensor, step: float, out: torch.Tensor | None) -> torch.Tensor:
    """int8 codes of ``flat`` at ``step`` (> 0), written into ``out`` when given (int8, ``flat.numel()``)."""
    if out is None:
        out = torch.empty(flat.numel(), dtype=torch.int8, device=flat.device)
    chunk = CPU_CHUNK_ELEMS if flat.is_cpu else max(1, flat.numel())
    scaled = torch.empty(min(chunk, flat.numel()), device=flat.device)
    for src, dst in zip(flat.split(chunk), out.split(chunk), strict=True):
        s = scaled[: src.numel()]
        if src.dtype == torch.float32:
            torch.mul(src, 1.0 / step, out=s)
        else:  # fp16 / bf16 in: scaled in float32, as the one-pass form did
            s.copy_(src).mul_(1.0 / step)
        s.round_().clamp_(-LEVEL, LEVEL)  # the clamp only guards float rounding at absmax / step ~ 127
        dst.copy_(s)
    return out


def decode(codes: torch.Tensor, step: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``codes * step`` as ``dtype`` on ``device`` (codes: int8, any device)."""
    codes = codes.to(device)
    if dtype != torch.float32 or not codes.is_cpu or codes.numel() <= CPU_CHUNK_ELEMS:
        return (codes.float() * step).to(dtype)
    out = torch.empty(codes.numel(), dtype=dtype)
    for src, dst in zip(codes.split(CPU_CHUNK_ELEMS), out.split(CPU_CHUNK_ELEMS), strict=True):
        torch.mul(src, step, out=dst)  # int8 times a float scalar promotes to float32, as .float() * step does
    return out
