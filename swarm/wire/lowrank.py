"""Low-rank coding of a boundary tensor: two thin int8 factors instead of every value.

Why: a codec that quantises values one at a time spends bits on every value, however little the tensor
holds; the tensors between stages of a small trained model hold little. As a ``tokens x d_model`` matrix,
gpt-medium's hidden states keep 99.9% of their energy in 32 of 256 singular directions after 300 steps,
its gradients 91% (``benchmarks/entropy.py``; docs/codecs.md, "Low rank"). A rank-``r`` code sends
``(tokens + d_model) x r`` values: on such a tensor far fewer bytes than ``int3_rot`` at a fraction of its
error. On a tensor without that structure it only loses what lies outside the ``r`` directions, so it is
opt-in, for models where ``benchmarks/entropy.py`` shows the structure.

The layout of the ``lowrank`` codec (``rank`` travels in the message, ``r <= min(m, n)``):

* ``x`` is viewed as ``X``, ``m x n`` with ``n`` its last dimension;
* ``X ~= P Q^T`` from ``LOWRANK_ITERS`` passes of subspace iteration from a seeded Gaussian start
  (``P`` has orthonormal columns, ``Q = X^T P``), as PowerSGD does for weight gradients; the sender's start
  never travels, so the receiver needs no seed;
* the payload is ``P^T`` (``r x m``) then ``Q^T`` (``r x n``), int8 codes, row-major, so each block of
  ``block_size`` runs along one factor column and gets a scale of its own magnitude;
* the scales are fp32 (4 bytes per block, ~6% of the payload at blocks of 64): ``P``'s entries are
  ~``1/sqrt(m)``, below fp16 scales' useful range, and ``Q`` carries the singular values.

Nothing here validates input: ``swarm.wire.codecs`` does that before calling in.
"""

from __future__ import annotations

import torch

from swarm.wire import quantize

LOWRANK_ITERS = 2
MAX_RANK = 4096


def effective_rank(rank: int, shape: tuple[int, ...]) -> int:
    m, n = quantize.matrix_shape(shape)
    return min(rank, m, n)


def sizes(rank: int, shape: tuple[int, ...], block_size: int) -> tuple[int, int, int, int]:
    """Payload elements of ``P^T`` and ``Q^T``, and their block counts, for an effective ``rank``."""
    m, n = quantize.matrix_shape(shape)
    p, q = rank * m, rank * n
    return p, q, quantize.num_blocks(p, block_size), quantize.num_blocks(q, block_size)


def factorise(x: torch.Tensor, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, Q)`` with ``x ~= P Q^T`` as an ``m x n`` matrix, ``rank`` columns each (float32)."""
    m, n = quantize.matrix_shape(tuple(x.shape))
    xm = x.detach().reshape(m, n).float()
    g = torch.Generator(device=xm.device).manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    q = torch.randn(n, rank, generator=g, device=xm.device)
    p = q
    for _ in range(LOWRANK_ITERS):
        p, _ = torch.linalg.qr(xm @ q)
        q = (p.T @ xm).T  # X^T P, the same values; as P^T X the product runs 2x faster on a large X (one core)
    return p, q


def encode(x: torch.Tensor, rank: int, seed: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload int8, scales float32)`` of ``x`` at ``rank`` (already ``effective_rank``)."""
    p, q = factorise(x, rank, seed)
    pc, ps = quantize.quantize(p.T.contiguous().view(-1), 8, block_size, None, torch.float32)
    qc, qs = quantize.quantize(q.T.contiguous().view(-1), 8, block_size, None, torch.float32)
    return torch.cat([pc, qc]), torch.cat([ps, qs])


def decode(
    payload: torch.Tensor,
    scales: torch.Tensor,
    shape: tuple[int, ...],
    rank: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``P Q^T`` from checked ``payload`` (int8) and ``scales`` (float32) of the sizes :func:`sizes` gives."""
    m, n = quantize.matrix_shape(shape)
    pn, qn, pb, _ = sizes(rank, shape, block_size)
    pt = quantize.dequantize(payload[:pn], scales[:pb], pn, 8, block_size, torch.float32, device)
    qt = quantize.dequantize(payload[pn:], scales[pb:], qn, 8, block_size, torch.float32, device)
    return (pt.view(rank, m).T @ qt.view(rank, n)).to(dtype).reshape(shape)
