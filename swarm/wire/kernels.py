"""Fused single-pass CPU kernels (numba) for the per-element work of the integer codecs.

Why: the torch path runs five whole-chunk kernels per chunk (``abs``, ``amax``, ``mul``, ``add``, a
narrowing copy), each a pass over the chunk; here the absmax of a row is one pass and
"multiply, round, narrow (and pack)" another, reading the chunk from L2 twice instead of five times.
The per-block *scale* arithmetic (a vector ``1 / B`` of the data) stays in torch in
``swarm.wire.quantize``, so the fp16 rounding of the scales, and with it every byte on the wire, is
exactly what the torch path produces: ``round_half_even(x * r)`` is what the torch path's
``+ 1.5 * 2**23`` trick computes, and decoding is the same single float32 multiply ``q * s``.

The kernels are compiled once per machine and cached on disk (``cache=True``); :func:`warm_up` pays
the compile (or cache load) up front so it never lands inside a timed call. Without numba (or on a
platform where it fails) :data:`AVAILABLE` is False and ``quantize`` keeps its pure-torch path, which
is also the only path on CUDA and other devices.
"""

from __future__ import annotations

import os

import numpy as np

try:  # pragma: no cover - exercised by the environment, not by a test
    if os.environ.get("RAVN_NO_NUMBA"):
        raise ImportError("disabled by RAVN_NO_NUMBA")
    import numba

    AVAILABLE = True
except ImportError:  # pragma: no cover
    numba = None
    AVAILABLE = False


def _jit(fn):
    if not AVAILABLE:
        return fn
    return numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")(fn)


@_jit
def row_absmax(bits, out):
    """``out[r] = max |x[r, :]|`` from the int32 bit patterns ``bits`` of float32 ``x``, into int32 ``out``.

    With the sign bit cleared, the bit patterns of non-negative floats order like the floats, and every
    NaN pattern lies above +Inf, so an integer max (which vectorises; a float max with NaN semantics
    does not) is the exact absmax, and a NaN anywhere in the row comes out as a NaN (refused later).
    """
    rows, n = bits.shape
    for r in range(rows):
        m = np.int32(0)
        for j in range(n):
            m = max(m, bits[r, j] & np.int32(0x7FFFFFFF))
        out[r] = m


@_jit
def quantize_int8(x, recip, dest):
    """``dest[r * n + j] = round_half_even(x[r, j] * recip[r])`` as int8 (the value is within +-127)."""
    rows, n = x.shape
    for r in range(rows):
        s = recip[r]
        base = r * n
        for j in range(n):
            dest[base + j] = np.int8(np.rint(x[r, j] * s))


@_jit
def quantize_int4(x, recip, dest):
    """Pairs of ``round_half_even(x * recip) + 8`` (1..15) packed low nibble first; ``n`` is even."""
    rows, n = x.shape
    half = n // 2
    for r in range(rows):
        s = recip[r]
        base = r * half
        for j in range(half):
            lo = np.int32(np.rint(x[r, 2 * j] * s)) + 8
            hi = np.int32(np.rint(x[r, 2 * j + 1] * s)) + 8
            dest[base + j] = np.uint8(lo | (hi << 4))


@_jit
def dequantize_int8(src, scales, out):
    """``out[r, j] = float32(src[r * n + j]) * scales[r]``."""
    rows, n = out.shape
    for r in range(rows):
        s = scales[r]
        base = r * n
        for j in range(n):
            out[r, j] = np.float32(src[base + j]) * s


@_jit
def dequantize_int4(src, scales, out):
    """Both nibbles of each byte, minus 8, times the row's scale; ``n`` is even."""
    rows, n = out.shape
    half = n // 2
    for r in range(rows):
        s = scales[r]
        base = r * half
        for j in range(half):
            b = np.int32(src[base + j])
            out[r, 2 * j] = np.float32((b & 15) - 8) * s
            out[r, 2 * j + 1] = np.float32((b >> 4) - 8) * s


def warm_up() -> None:
    """Compile (or load from the cache) every kernel now, on tiny arrays, not inside a timed call."""
    if not AVAILABLE:
        return
    x = np.zeros((1, 2), np.float32)
    v = np.ones(1, np.float32)
    row_absmax(x.view(np.int32), v.view(np.int32))
    quantize_int8(x, v, np.zeros(2, np.int8))
    quantize_int4(x, v, np.zeros(1, np.uint8))
    dequantize_int8(np.zeros(2, np.int8), v, x)
    dequantize_int4(np.zeros(1, np.uint8), v, x)
