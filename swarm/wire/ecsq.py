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

Nothing here validates input: ``swarm.wire.codecs`` does that before calling in.
"""

from __future__ import annotations

import math

import torch

STEP_PER_RMS = 0.87  # step / rms(x): relative error 0.25 on Gaussian data, int3_rot's there
LEVEL = 127  # the largest |code| the encoder writes (a decoder accepts any int8)
MIN_STEP = torch.finfo(torch.float32).tiny  # a tensor of subnormal values decodes to zeros, within step / 2
MAX_STEP = torch.finfo(torch.float32).max / 128  # any int8 code times the step stays finite


def step_of(flat: torch.Tensor, absmax: float) -> float:
    """The quantisation step of a finite, flat float tensor whose largest magnitude is ``absmax`` (0 for an
    empty or all-zero one)."""
    if not flat.numel() or absmax == 0.0:
        return 0.0
    rms = float(torch.linalg.vector_norm(flat, dtype=torch.float64)) / math.sqrt(flat.numel())
    step = max(STEP_PER_RMS * rms, absmax / LEVEL, MIN_STEP)
    return float(torch.tensor(step, dtype=torch.float32))  # what travels (a code moves by < 1e-6 at most)


def encode(flat: torch.Tensor, step: float, out: torch.Tensor | None) -> torch.Tensor:
    """int8 codes of ``flat`` at ``step`` (> 0), written into ``out`` when given (int8, ``flat.numel()``)."""
    scaled = flat.float() * (1.0 / step)
    scaled.round_().clamp_(-LEVEL, LEVEL)  # the clamp only guards float rounding at absmax / step ~ 127
    if out is None:
        return scaled.to(torch.int8)
    return out.copy_(scaled)


def decode(codes: torch.Tensor, step: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``codes * step`` as ``dtype`` on ``device`` (codes: int8, any device)."""
    return (codes.to(device).float() * step).to(dtype)
