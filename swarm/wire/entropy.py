"""Lossless zstd coding of 4-bit codes on the wire, where it buys time on a home link.

Quantised codes are not uniform: after the rotation most values of a block sit in the middle levels, so a
byte of two 4-bit codes carries fewer than 8 bits of information. On gpt-medium's boundary tensors
(4 x 128 x 256, after 300 steps of training) zstd at level 1 made int4_rot activations 29-34% and int4_rot
gradients 13-16% smaller (70% at step 50, 11% at init), at 350-1,000 MB/s to compress and ~1 GB/s to
decompress on one core: a tensor of 70 KB costs ~0.2 ms, against 56 ms on a 10 Mbit/s link (docs/codecs.md,
"Entropy coding"). int8 codes shrank by 3-5% and bf16 by 19-22%; bf16 is what auto's ladder sends on fast
links, where the time to compress would not be won back, so only 4-bit codes are coded.

The receiver never trusts the frame: its declared content size must equal the exact payload size the
header implies (known before anything is allocated), and nothing may follow the frame.
"""

from __future__ import annotations

import zstandard

LEVEL = 1  # level 3 took 1-3 points more off int4_rot activations, more slowly (one exploratory run)
CODED = frozenset({"int4", "int4_rot", "int3_rot"})  # codecs whose payloads are zstd-coded when the run allows it
_compressor = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)


class EntropyError(ValueError):
    """A coded payload that cannot be accepted."""


def worth_coding(codec: str) -> bool:
    return codec in CODED


def compress(payload: bytes) -> bytes:
    return _compressor.compress(payload)


def decompress(data: bytes, expected: int) -> bytes:
    """The payload of exactly ``expected`` bytes coded in ``data`` (EntropyError otherwise)."""
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as e:
        raise EntropyError(f"coded payload is not a zstd frame: {e}") from None
    if declared != expected:
        raise EntropyError(f"coded payload declares {declared} bytes; the header implies {expected}")
    d = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = d.decompress(data)
    except zstandard.ZstdError as e:
        raise EntropyError(f"coded payload is corrupt: {e}") from None
    if len(out) != expected or not d.eof or d.unused_data:
        raise EntropyError(f"coded payload gave {len(out)} bytes (expected {expected}) or has trailing data")
    return out
