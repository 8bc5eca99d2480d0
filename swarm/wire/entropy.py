"""Lossless zstd coding of 4-bit codes on the wire, where it buys time on a home link.

Quantised codes are not uniform: after the rotation most values of a block sit in the middle levels, so a
byte of two 4-bit codes carries fewer than 8 bits of information. On gpt-medium's boundary tensors
(4 x 128 x 256, after 300 steps of training) zstd at level 1 made int4_rot activations 29-37% and int4_rot
gradients 13-16% smaller, at 150-600 MB/s to compress and ~1 GB/s to decompress on one core: a tensor of
70 KB costs ~0.2 ms, against 56 ms on a 10 Mbit/s link (docs/codecs.md, "Entropy coding"). int8 codes
shrank by 4-6% and bf16 by 19-22%; those codecs go on fast links (auto's ladder starts with bf16 on a LAN),
where the time to compress would not be won back, so only 4-bit codes are coded.

The receiver never trusts the frame: its declared content size must equal the exact payload size the
header implies (known before anything is allocated), and nothing may follow the frame.
"""

from __future__ import annotations

import zstandard

LEVEL = 1  # level 3 compressed 1-4 points more at half the speed: not worth it at home-link speeds
CODED = frozenset({"int4", "int4_rot"})  # codecs whose payloads are zstd-coded when the run allows it
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
