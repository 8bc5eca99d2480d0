"""Lossless zstd coding of 4-bit codes on the wire, where it buys time on a home link.

Quantised codes are not uniform: after the rotation most values of a block sit in the middle levels, so a
byte of two 4-bit codes carries fewer than 8 bits of information. On gpt-medium's boundary tensors
(4 x 128 x 256, after 300 steps of training) zstd at level 1 made int4_rot activations 29-34% and int4_rot
gradients 13-16% smaller (70% at step 50, 11% at init), at 350-1,000 MB/s to compress and ~1 GB/s to
decompress on one core: a tensor of 70 KB costs ~0.2 ms, against 56 ms on a 10 Mbit/s link (docs/codecs.md,
"Entropy coding"). int8 codes shrank by 3-5% and bf16 by 19-22%; bf16 is what auto's ladder sends on fast
links, where the time to compress would not be won back, so only 4-bit codes are coded.

Their scales travel coded too, as byte planes: once the codes are coded, the scales (2 bytes per block of
64 for activations, 4 for the ~1e-7 gradients, whose scales fp16 cannot hold) are 16-20% of int3_rot's
bytes. A scale's high byte (sign, exponent, the top of the mantissa) takes few values, its low bytes are
nearly uniform, so all first bytes, then all second ones, ... in one frame take 25-31% off fp16 scales and
16-24% off fp32 ones on gpt-medium's boundary tensors (``benchmarks/entropy.py``; 4.5-8% of int3_rot's bytes
in a 300-step run, docs/codecs.md, "Coded scales"); zstd over the scales as they lie took about a third
less (one exploratory run). Coded with the codes in one frame they would spoil its statistics.

The receiver never trusts the frame: its declared content size must equal the exact payload size the
header implies (known before anything is allocated), and nothing may follow the frame.
"""

from __future__ import annotations

import numpy as np
import zstandard

LEVEL = 1  # level 3 took 1-3 points more off int4_rot activations, more slowly (one exploratory run)
CODED = frozenset({"int4", "int4_rot", "int3_rot"})  # codecs whose payloads are zstd-coded when the run allows
_compressor = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)


class EntropyError(ValueError):
    """A coded payload that cannot be accepted."""


def worth_coding(codec: str) -> bool:
    return codec in CODED


def compress(payload: bytes) -> bytes:
    return _compressor.compress(payload)


def decompress(data: bytes, expected: int | tuple[int, ...], *, what: str = "coded payload") -> bytes:
    """The ``what`` of exactly ``expected`` bytes (or one of the sizes given) coded in ``data``, else EntropyError.

    The frame's declared size is checked against the header's before anything is decompressed, and
    decompression stops there, so a small frame of many zeros cannot make the receiver hold more.
    """
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as e:
        raise EntropyError(f"{what} is not a zstd frame: {e}") from None
    sizes = (expected,) if isinstance(expected, int) else expected
    if declared not in sizes:
        implied = " or ".join(map(str, sizes))
        raise EntropyError(f"{what} declares {declared} bytes; the header implies {implied}")
    d = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = d.decompress(data)
    except zstandard.ZstdError as e:
        raise EntropyError(f"{what} is corrupt: {e}") from None
    if len(out) != declared or not d.eof or d.unused_data:
        raise EntropyError(f"{what} gave {len(out)} bytes (expected {declared}) or has trailing data")
    return out


def compress_planes(scales: bytes, nblocks: int) -> bytes | None:
    """``scales`` (``nblocks`` scales of 2 or 4 bytes) coded as byte planes; None when that is not smaller."""
    if not nblocks or not scales:
        return None
    planes = np.frombuffer(scales, dtype=np.uint8).reshape(nblocks, -1).T.tobytes()
    frame = _compressor.compress(planes)
    return frame if len(frame) < len(scales) else None


def decompress_planes(data: bytes, nblocks: int) -> bytes:
    """The scales of ``nblocks`` blocks (fp16 or fp32: 2 or 4 bytes each) coded in ``data`` as byte planes."""
    if nblocks <= 0:
        raise EntropyError("coded scales for a tensor without blocks")
    planes = decompress(data, (2 * nblocks, 4 * nblocks), what="the scales' frame")  # fp16 or fp32 scales
    return np.frombuffer(planes, dtype=np.uint8).reshape(-1, nblocks).T.tobytes()
