"""Blockwise absmax quantisation to int8 and int4: the arithmetic behind the integer codecs.

Layout (the wire format of ``int8``, ``int4`` and ``int4_rot``):

* the tensor is flattened; block ``b`` holds elements ``[b * B, (b + 1) * B)``, the last block may be
  shorter (it is padded only logically: the payload carries exactly ``numel`` values);
* each block has one fp16 scale ``s_b >= absmax_b / L`` (``L = 127`` for int8, ``7`` for int4), the
  fp16 value at or just above it, so ``round(x / s_b)`` never leaves ``[-L, L]`` and no clamp is needed;
  a tensor whose scales would overflow fp16 (``absmax / L > 65504``: int4 near 4.6e5, int4_rot lower,
  since the rotation can pile a block into one entry) carries fp32 scales instead, 4 bytes per block
  (the receiver tells them apart by their length), so any finite tensor up to fp32's range encodes;
  so does a tensor whose largest scale is below ``FP16_SCALE_MIN`` (2**-10): fp16 scales there are near
  or below its subnormal range (steps of 2**-24), which rounded a gradient's scales up by several times
  and cost it 5-17% of its norm; with fp32 scales every tensor keeps the same relative precision;
* int8 values are two's complement bytes; int4 values are stored as ``q + 8`` (1..15), two per byte,
  element ``2i`` in the low nibble and ``2i + 1`` in the high nibble; an odd tail leaves the last high
  nibble 0;
* with a rotation (``int4_rot``) every *full* block is quantised as ``H D x / sqrt(B)`` and restored
  with ``D H y / sqrt(B)``; a trailing partial block is plain int4.

Speed is the point of this module, because the encoder and decoder sit on the critical path of every
micro-batch. On CPU the work is streamed in chunks of ``CPU_CHUNK_ELEMS`` elements through scratch
buffers that stay in L2, so each element is read from memory once and written once; every op in the
loop is a vectorised torch kernel over a whole chunk (the Python loop runs ~100 times for 64 MiB, not
once per block). Rounding uses the float trick ``v + 1.5 * 2**23``: the low mantissa bits of the sum
are ``round_half_even(v)`` in two's complement, so "add, reinterpret as int32, narrow" does rounding and
conversion in two cheap passes. On other devices the "chunk" is the whole tensor, as a GPU wants.

Nothing here validates input: ``swarm.wire.codecs`` does that before calling in.
"""

from __future__ import annotations

import functools
import math
import threading

import torch

from swarm.wire.hadamard import BlockRotation

LEVELS = {8: 127, 4: 7}
CPU_CHUNK_ELEMS = 1 << 17  # 512 KiB of float32: input, two scratch buffers and output fit in L2
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds |v| < 2**22 to an integer held in the low bits
_SCALE_MARGIN = 1.0 + 2.0**-10  # lifts absmax / L past the next fp16 step: fp16 rounding never goes below
FP16_SCALE_MIN = 2.0**-10  # a tensor whose largest fp16 scale is below this is sent with fp32 scales
_FP32_SCALE_FLOOR = 2.0**-100  # fp32 scales' floor: keeps 1 / s finite, far below any block that matters
# The same for subnormal fp16 scales (spacing 2**-24): just past the tie, so even an all-zero block
# gets the nonzero scale 2**-24 and 1 / s never divides by zero.
_SCALE_FLOOR = 2.0**-25 * _SCALE_MARGIN


_local = threading.local()


def _scratch(
    name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A scratch buffer reused across calls on CPU (per thread), fresh elsewhere.

    A fresh CPU buffer page-faults on first touch (~0.5 ms per call for these), a visible share of
    encoding a few MiB. The cache holds a few chunk-sized buffers (~2 MiB) per thread.
    On a GPU the "chunk" is the whole tensor, so nothing is kept there.
    """
    numel = math.prod(shape)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    cache: dict[str, torch.Tensor] = _local.__dict__.setdefault("buffers", {})
    buf = cache.get(name)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = cache[name] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(m, n)``: the tensor as rows of its last dimension (a 0- or 1-d tensor is one row)."""
    n = shape[-1] if shape else 1
    m = 1
    for d in shape[:-1]:
        m *= d
    return m, n


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def payload_nbytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def _rows_per_chunk(full_blocks: int, block_size: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(full_blocks, 1)
    return max(1, min(full_blocks, CPU_CHUNK_ELEMS // block_size))


def _tail_bytes(first: int, bits: int) -> slice:
    """Payload bytes from element ``first`` (even for int4: blocks never share a byte) to the end."""
    return slice(first if bits == 8 else first // 2, None)


@functools.lru_cache(maxsize=4)
def _nibble_table(device: torch.device) -> torch.Tensor:
    """For each byte, the float32 pair ``(low - 8, high - 8)`` as one int64, for a single gather."""
    b = torch.arange(256)
    pairs = torch.stack([b % 16, b // 16], dim=1).float() - 8
    return pairs.view(torch.int64).view(256).to(device)


def quantize(
    flat: torch.Tensor,
    bits: int,
    block_size: int,
    rotation: BlockRotation | None = None,
    scale_dtype: torch.dtype = torch.float16,
    payload: torch.Tensor | None = None,
    levels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a flat contiguous float tensor; returns ``(payload, scales)`` on its device.

    ``payload`` is int8 (``bits=8``) or packed uint8 (``bits=4``); ``scales`` is ``scale_dtype`` (fp16,
    or fp32 for values beyond fp16 scales), one per block. A ``payload`` passed in (of that dtype and
    :func:`payload_nbytes` elements, e.g. the memory of the ``bytes`` that will travel) is filled instead
    of a new one. ``levels`` is the largest code, ``LEVELS[bits]`` unless fewer are asked for (``int3_rot``
    packs codes in -3..3 as int4 does).
    Non-finite input is not refused here: it shows up as non-finite scales, which the caller checks.
    """
    n = flat.numel()
    device = flat.device
    full = n // block_size
    tail = n - full * block_size
    levels = LEVELS[bits] if levels is None else levels
    scales = torch.empty(full + (1 if tail else 0), dtype=scale_dtype, device=device)
    if payload is None:
        payload = torch.empty(payload_nbytes(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
    offset = torch.full((), _ROUND_MAGIC + (8 if bits == 4 else 0), device=device)
    floor = torch.full((), _SCALE_FLOOR if scale_dtype == torch.float16 else _FP32_SCALE_FLOOR, device=device)
    rotated = rotation is not None
    if full:
        rows = _rows_per_chunk(full, block_size, device)
        # Scratch: b always; a for converted input or the rotation's spare; c for the rotation.
        a = _scratch("a", (rows, block_size), device) if rotated or flat.dtype != torch.float32 else None
        b = _scratch("b", (rows, block_size), device)
        c = _scratch("c", (rows, block_size), device) if rotated else None
        vec = _scratch("vec", (rows,), device)
        gain = 1.0 / math.sqrt(block_size) if rotated else 1.0
        # One split per array up front: the loop body is then only the vectorised kernels.
        xs = flat[: full * block_size].view(full, block_size).split(rows)
        dests = payload[: full * block_size * bits // 8].split(rows * block_size * bits // 8)
        for x, dest, s in zip(xs, dests, scales[:full].split(rows), strict=True):
            k = x.shape[0]
            if x.dtype != torch.float32:
                x = a[:k].copy_(x)
            if rotated:
                x = rotation.forward(x, b[:k], c[:k])  # lands in b or c, never a
            abuf = a[:k] if rotated else b[:k]
            _quantize_rows(x, levels, gain, floor, offset, s, dest, abuf, vec[:k])
    if tail:
        x = flat[full * block_size :].view(1, tail).float()
        dest = payload[_tail_bytes(full * block_size, bits)]
        abuf, vec = torch.empty_like(x), torch.empty(1, device=device)
        _quantize_rows(x, levels, 1.0, floor, offset, scales[full:], dest, abuf, vec)
    return payload, scales


def _quantize_rows(
    x: torch.Tensor,
    levels: int,
    gain: float,
    floor: torch.Tensor,
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
    _scales_from_absmax(vec, levels, gain, floor, scales_out)
    torch.mul(x, vec[:, None], out=abuf)
    abuf.add_(offset)  # offset + round(x * gain / s) in the low bits (one addcmul is 3x slower on CPU)
    ints = abuf.view(torch.int32).view(-1)
    if dest.dtype == torch.int8:
        dest.copy_(ints)  # int32 -> int8 keeps the low byte: the two's complement of the rounded value
    else:
        _pack_nibbles(ints, dest)


def _scales_from_absmax(
    vec: torch.Tensor, levels: int, gain: float, floor: torch.Tensor, scales_out: torch.Tensor
) -> None:
    """Row absmax in ``vec`` -> scales in ``scales_out``; ``vec`` becomes ``gain / scale``, the multiplier.

    The fp16 rounding of these scales decides every byte on the wire (pinned by tests/test_codec_golden.py).
    """
    torch.add(floor, vec, alpha=gain * _SCALE_MARGIN / levels, out=vec)
    scales_out.copy_(vec)  # round to fp16 (or fp32): >= absmax / L, > 0 (inf if it overflows fp16)
    vec.copy_(scales_out).reciprocal_()  # 1 / the scale the receiver will see
    if gain != 1.0:
        vec.mul_(gain)


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
    rotation: BlockRotation | None = None,
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
    table = _nibble_table(device) if bits == 4 else None
    if full:
        rows = _rows_per_chunk(full, block_size, device)
        direct = dtype == torch.float32 and rotation is None  # dequantise straight into the output
        a = None if direct else _scratch("a", (rows, block_size), device)
        b = _scratch("b", (rows, block_size), device) if rotation is not None and dtype != torch.float32 else None
        c = _scratch("c", (rows, block_size), device) if rotation is not None else None
        index = _scratch("index", (rows * block_size // 2,), device, torch.int32) if bits == 4 else None
        if rotation is not None:
            scales = scales.clone()
            scales[:full] /= math.sqrt(block_size)
        outs = out[: full * block_size].view(full, block_size).split(rows)
        srcs = payload[: full * block_size * bits // 8].split(rows * block_size * bits // 8)
        for o, src, s in zip(outs, srcs, scales[:full].split(rows), strict=True):
            k = o.shape[0]
            w = o if direct else a[:k]
            _dequantize_rows(src, s, w, table, index)
            if rotation is not None:
                r = rotation.inverse(w, o if dtype == torch.float32 else b[:k], c[:k])
                if r is not o:
                    o.copy_(r)
            elif w is not o:
                o.copy_(w)
    if tail:
        w = torch.empty(1, tail + (tail & 1 if bits == 4 else 0), device=device)
        src = payload[_tail_bytes(full * block_size, bits)]
        index = torch.empty(src.numel(), dtype=torch.int32, device=device)
        _dequantize_rows(src, scales[full:], w, table, index)
        out[full * block_size :].copy_(w.view(-1)[:tail])
    return out


def _dequantize_rows(
    src: torch.Tensor, scales: torch.Tensor, w: torch.Tensor, table: torch.Tensor | None, index: torch.Tensor | None
) -> None:
    """``w[r, :] = q[r, :] * scales[r]`` with ``q`` read from ``src``; ``w`` is float32 (maybe padded)."""
    if table is None:
        w.view(-1).copy_(src)
    else:
        # one gather of 8 bytes per payload byte: both nibbles, already minus 8, as a float32 pair
        idx = index[: src.numel()].copy_(src)
        torch.index_select(table, 0, idx, out=w.view(-1).view(torch.int64))
    w.mul_(scales[:, None])
