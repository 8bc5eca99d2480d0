"""Blockwise absmax quantisation to int8 and int4: the arithmetic behind the integer codecs.

Layout (the wire format of ``int8``, ``int4`` and ``int4_rot``):

* the tensor is flattened; block ``b`` holds elements ``[b * B, (b + 1) * B)``, the last block may be
  shorter (it is padded only logically: the payload carries exactly ``numel`` values);
* each block has one fp16 scale ``s_b >= absmax_b / L`` (``L = 127`` for int8, ``7`` for int4), the
  smallest-ish fp16 at or above it, so ``round(x / s_b)`` never leaves ``[-L, L]`` and no clamp is
  needed;
* int8 values are two's complement bytes; int4 values are stored as ``q + 8`` (1..15), two per byte,
  element ``2i`` in the low nibble and ``2i + 1`` in the high nibble; an odd tail leaves the last high
  nibble 0.

Speed is the point of this module, because the encoder and decoder sit on the critical path of every
micro-batch. On CPU the work is streamed in chunks of about ``CPU_CHUNK_ELEMS`` elements through
preallocated scratch buffers that fit in L2, so each element is read from memory once and written
once; every op inside the loop is a vectorised torch kernel over a whole chunk (the Python loop runs
tens of times, not per block). Rounding uses the float trick ``x + 1.5 * 2**23``: its low mantissa bits
are ``round_half_even(x)`` in two's complement, so "add, then reinterpret as int32, then narrow" fuses
scaling, rounding and conversion into one ``addcmul`` and one narrowing copy. On other devices the
"chunk" is the whole tensor, which is what a GPU wants.

Nothing here validates input: ``swarm.codecs`` does that before calling in.
"""

from __future__ import annotations

import math

import torch

from swarm.hadamard import fwht_

LEVELS = {8: 127, 4: 7}
CPU_CHUNK_ELEMS = 1 << 17
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds a |v| < 2**22 float to an integer in its low bits
_SCALE_MARGIN = 1.0 + 2.0**-10  # pushes absmax / L over the next fp16 step, so fp16 rounding never goes below
_SCALE_FLOOR = 2.0**-25 * _SCALE_MARGIN  # same for subnormal fp16 scales (spacing 2**-24): past the tie
_MIN_FP16 = 2.0**-24


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def payload_nbytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def _rows_per_chunk(full_blocks: int, block_size: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(full_blocks, 1)
    return max(1, CPU_CHUNK_ELEMS // block_size)


def _tail_bytes(first: int, bits: int) -> slice:
    """Payload bytes from element ``first`` (even for int4: blocks never share a byte) to the end."""
    return slice(first if bits == 8 else first // 2, None)


def quantize(
    flat: torch.Tensor, bits: int, block_size: int, signs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a flat contiguous float tensor; returns ``(payload, scales)`` on its device.

    ``payload`` is int8 (``bits=8``) or packed uint8 (``bits=4``); ``scales`` is fp16, one per block.
    With ``signs`` (a ``block_size`` vector of +-1) every full block is first rotated by
    ``H diag(signs) / sqrt(block_size)``; the trailing partial block, if any, is never rotated.
    Non-finite input is not refused here: it shows up as non-finite scales, which the caller checks.
    """
    n = flat.numel()
    device = flat.device
    full = n // block_size
    tail = n - full * block_size
    levels = LEVELS[bits]
    scales = torch.empty(full + (1 if tail else 0), dtype=torch.float16, device=device)
    payload = torch.empty(payload_nbytes(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
    offset = torch.full((), _ROUND_MAGIC + (8 if bits == 4 else 0), device=device)
    if full:
        rows = min(_rows_per_chunk(full, block_size, device), full)
        work = torch.empty(rows, block_size, device=device)
        scratch = torch.empty_like(work)
        vec = torch.empty(rows, device=device)
        gain = 1.0 / math.sqrt(block_size) if signs is not None else 1.0
        # One split per array up front: the loop body is then only the vectorised kernels.
        xs = flat[: full * block_size].view(full, block_size).split(rows)
        dests = payload[: full * block_size * bits // 8].split(rows * block_size * bits // 8)
        for x, dest, s in zip(xs, dests, scales[:full].split(rows), strict=True):
            k = x.shape[0]
            if signs is not None:
                torch.mul(x, signs, out=work[:k])
                x = fwht_(work[:k], scratch[:k])
            elif x.dtype != torch.float32:
                x = work[:k].copy_(x)
            abuf = scratch[:k] if x.data_ptr() != scratch.data_ptr() else work[:k]
            _quantize_rows(x, levels, gain, offset, s, dest, abuf, vec[:k])
    if tail:
        x = flat[full * block_size :].view(1, tail).float()
        dest = payload[_tail_bytes(full * block_size, bits)]
        _quantize_rows(x, levels, 1.0, offset, scales[full:], dest, torch.empty_like(x), torch.empty(1, device=device))
    return payload, scales


def _quantize_rows(
    x: torch.Tensor,
    levels: int,
    gain: float,
    offset: torch.Tensor,
    scales_out: torch.Tensor,
    dest: torch.Tensor,
    abuf: torch.Tensor,
    vec: torch.Tensor,
) -> None:
    """Quantise the rows of ``x`` (one block each) into ``dest``, scales into ``scales_out``.

    ``gain`` multiplies ``x`` before quantisation (the rotation's ``1 / sqrt(B)``, folded in here so the
    transform itself stays unnormalised). ``abuf`` and ``vec`` are scratch and must not alias ``x``.
    """
    torch.abs(x, out=abuf)
    torch.amax(abuf, dim=1, out=vec)
    vec.mul_(gain * _SCALE_MARGIN / levels).add_(_SCALE_FLOOR)
    scales_out.copy_(vec)  # round to fp16; lands at or above absmax / L (inf if it overflows fp16)
    vec.copy_(scales_out).clamp_min_(_MIN_FP16).reciprocal_().mul_(gain)  # exactly what the receiver sees
    torch.mul(x, vec[:, None], out=abuf)
    abuf.add_(offset)  # offset + round(x * gain / s) in the low bits (addcmul is 3x slower on CPU)
    ints = abuf.view(torch.int32).view(-1)
    if dest.dtype == torch.int8:
        dest.copy_(ints)  # int32 -> int8 keeps the low byte: the two's complement of the rounded value
    else:
        _pack_nibbles(ints, dest)


def _pack_nibbles(ints: torch.Tensor, dest: torch.Tensor) -> None:
    """Pack low nibbles of ``ints`` pairwise: ``dest[i] = ints[2i] | ints[2i + 1] << 4`` (low bytes)."""
    even = ints.numel() // 2 * 2
    if even:
        # The high bits of the int32s are junk from the float trick; a + 16 * b keeps them out of the
        # low byte because both low bytes are < 16, and the narrowing to uint8 drops them.
        torch.add(ints[0:even:2], ints[1:even:2], alpha=16, out=dest[: even // 2])
    if even != ints.numel():
        dest[-1:].copy_(ints[-1:] & 15)


def dequantize(
    payload: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: a flat tensor of ``dtype`` on ``device``.

    ``payload`` (int8 or uint8) and ``scales`` (float32, already checked finite) may be on the CPU; they
    are moved to ``device`` first so a GPU receiver uploads the compact form and dequantises there.
    """
    payload = payload.to(device)
    scales = scales.to(device)
    out = torch.empty(numel, dtype=dtype, device=device)
    full = numel // block_size
    tail = numel - full * block_size
    if full:
        rows = min(_rows_per_chunk(full, block_size, device), full)
        need_work = dtype != torch.float32 or signs is not None
        work = torch.empty(rows, block_size, device=device) if need_work else None
        scratch = torch.empty(rows, block_size, device=device) if signs is not None else None
        unpack_tmp = torch.empty(rows * block_size // 2, dtype=torch.uint8, device=device) if bits == 4 else None
        if signs is not None:
            scales = scales.clone()
            scales[:full] /= math.sqrt(block_size)
        outs = out[: full * block_size].view(full, block_size).split(rows)
        srcs = payload[: full * block_size * bits // 8].split(rows * block_size * bits // 8)
        for o, src, s in zip(outs, srcs, scales[:full].split(rows), strict=True):
            k = o.shape[0]
            w = work[:k] if work is not None else o
            _dequantize_rows(src, bits, s, w, unpack_tmp)
            if signs is not None:
                torch.mul(fwht_(w, scratch[:k]), signs, out=o)
            elif w is not o:
                o.copy_(w)
    if tail:
        w = torch.empty(1, tail + (tail & 1 if bits == 4 else 0), device=device)
        src = payload[_tail_bytes(full * block_size, bits)]
        _dequantize_rows(src, bits, scales[full:], w, torch.empty(src.numel(), dtype=torch.uint8, device=device))
        out[full * block_size :].copy_(w.view(-1)[:tail])
    return out


def _dequantize_rows(
    src: torch.Tensor, bits: int, scales: torch.Tensor, w: torch.Tensor, unpack_tmp: torch.Tensor | None
) -> None:
    """``w[r, :] = q[r, :] * scales[r]`` with ``q`` read from ``src`` (``w`` is float32, may be padded)."""
    s = scales[:, None]
    if bits == 8:
        w.view(-1).copy_(src)
        w.mul_(s)
        return
    nbytes = src.numel()
    pairs = w.view(-1)[: 2 * nbytes].view(nbytes, 2)
    tmp = unpack_tmp[:nbytes]
    torch.bitwise_and(src, 15, out=tmp)
    pairs[:, 0].copy_(tmp)
    torch.bitwise_right_shift(src, 4, out=tmp)
    pairs[:, 1].copy_(tmp)
    torch.addcmul(s * -8.0, w, s, out=w)  # (v - 8) * s
