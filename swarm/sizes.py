"""Byte sizes as people write them (``20GiB``, ``512MB``, ``1.5G``) and as messages print them."""

from __future__ import annotations

import math
import re

UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number and an optional unit (B, KB/MB/GB/TB in 1000s; K/M/G/T or KiB..TiB in 1024s)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 20GiB, 512MiB or 8GB")
    size = float(m.group(1)) * UNITS[unit]
    if not math.isfinite(size) or size >= 2**50:
        raise ValueError(f"{text!r} is too large")
    return int(size)


def format_size(n: float) -> str:
    """``n`` bytes in binary units, three significant digits: ``1.5 GiB``, ``640 KiB``, ``12 B``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
