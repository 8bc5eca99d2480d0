"""Seeded randomised Hadamard rotation of fixed-size blocks, the trick behind the ``int4_rot`` codec.

A block with a few large outliers quantises badly: one absmax scale is spent on one value and the rest
round to zero. Rotating the block by ``H D / sqrt(n)`` (``D`` random signs, ``H`` the Walsh-Hadamard
matrix) spreads every outlier over all ``n`` coefficients, so the rotated block is close to Gaussian
and its absmax is much nearer its typical magnitude. The rotation is orthonormal (the quantisation
error keeps its L2 norm on the way back) and is fully determined by ``(seed, n)``, so only the seed
travels.

The signs come from SplitMix64, written out here rather than drawn from ``torch.Generator``, because
sender and receiver may run different torch builds and the wire format must not depend on either.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def splitmix64(seed: int, count: int) -> np.ndarray:
    """The first ``count`` outputs of SplitMix64 started at ``seed`` (the state before the first step).

    Output ``i`` is ``mix(seed + (i + 1) * 0x9E3779B97F4A7C15 mod 2**64)``, the reference algorithm
    (Steele, Lea, Flood 2014), so any language can rebuild the signs.
    """
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed {seed} is not an unsigned 64-bit integer")
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=64)
def _signs_cpu(seed: int, n: int) -> torch.Tensor:
    top_bits = (splitmix64(seed, n) >> np.uint64(63)).astype(np.float32)
    return torch.from_numpy(1.0 - 2.0 * top_bits)  # bit 63 set -> -1, clear -> +1


def random_signs(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The diagonal of ``D``: ``n`` float32 values in {+1, -1}, a pure function of ``(seed, n)``."""
    signs = _signs_cpu(seed, n)
    return signs if torch.device(device).type == "cpu" else signs.to(device)


DENSE_MAX = 64  # up to this size a dense matmul beats log2(n) strided butterfly passes (~4x at 64)


@functools.lru_cache(maxsize=16)
def hadamard_matrix(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (entries +-1, symmetric, ``H @ H = n I``)."""
    if not is_power_of_two(n):
        raise ValueError(f"Hadamard matrices here need a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fwht_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform of every row of ``x`` (shape ``(rows, n)``).

    ``H_n = H_{n/m} (x) H_m``: the innermost ``m = min(n, DENSE_MAX)`` points are done as one dense
    matmul (a few hundred FLOPs per element but one cache-friendly kernel), the remaining ``log2(n/m)``
    butterfly passes as two vectorised ops each over contiguous runs of at least ``m`` elements. The
    passes ping-pong between ``x`` and ``scratch`` (same shape, contiguous float32), so nothing is
    allocated; both are overwritten and the returned tensor is whichever holds the result. Multiply by
    ``1 / sqrt(n)`` to make it orthonormal (it is then its own inverse).
    """
    rows, n = x.shape
    if not is_power_of_two(n):
        raise ValueError(f"Walsh-Hadamard transform needs a power-of-two length, got {n}")
    m = min(n, DENSE_MAX)
    dense = hadamard_matrix(m).to(x.device)
    torch.mm(x.view(-1, m), dense, out=scratch.view(-1, m))
    src, dst = scratch, x
    h = m
    while h < n:
        a = src.view(rows, n // (2 * h), 2, h)
        b = dst.view(rows, n // (2 * h), 2, h)
        torch.add(a[:, :, 0], a[:, :, 1], out=b[:, :, 0])
        torch.sub(a[:, :, 0], a[:, :, 1], out=b[:, :, 1])
        src, dst = dst, src
        h *= 2
    return src


class BlockRotation:
    """``H D`` and its inverse ``D H`` on rows of ``n`` elements, unnormalised (both scale by ``n``).

    For ``n <= DENSE_MAX`` the signs are folded into one dense matrix, so a rotation is a single matmul.
    """

    def __init__(self, seed: int, n: int, device: torch.device | str = "cpu") -> None:
        self.n = n
        self.signs = random_signs(seed, n, device)
        self._dense = None
        if n <= DENSE_MAX:
            self._dense = (self.signs[:, None] * hadamard_matrix(n).to(self.signs.device)).contiguous()

    def forward(self, x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` (float32) mapped by ``H D``; result in ``out`` or ``scratch`` (returned)."""
        if self._dense is not None:
            return torch.mm(x, self._dense, out=out)  # row form of H D x: x @ (D H)
        torch.mul(x, self.signs, out=out)
        return fwht_(out, scratch)

    def inverse(self, y: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """Rows of ``y`` mapped by ``D H`` into ``out`` (returned); ``y`` and ``scratch`` are clobbered."""
        if self._dense is not None:
            return torch.mm(y, self._dense.T, out=out)  # row form of D H y: y @ (H D)
        return torch.mul(fwht_(y, scratch), self.signs, out=out)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Reference rotation ``H D x / sqrt(n)`` of each row as a plain dense product (slow; for tests)."""
    n = x.shape[-1]
    h = hadamard_matrix(n).to(x.device)
    return (x.float() * random_signs(seed, n, x.device)) @ h / math.sqrt(n)


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """Reference inverse of :func:`rotate`: ``D H y / sqrt(n)``."""
    n = y.shape[-1]
    h = hadamard_matrix(n).to(y.device)
    return (y.float() @ h) / math.sqrt(n) * random_signs(seed, n, y.device)
