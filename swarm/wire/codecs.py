"""Tensor codecs for the wire: turn a tensor into bytes (and back) as cheaply as the link needs.

The network, not compute, is the bottleneck of a home-internet swarm, so every byte on the wire goes
through a codec chosen per direction (activations forward, gradients backward). Codecs are pure torch:
they know nothing of protobuf or gRPC (``swarm.wire.packets`` maps an ``EncodedTensor`` onto the wire message).
Decoding validates sizes before allocating anything, because the bytes come from strangers.

Codecs:

* ``fp32`` / ``fp16`` / ``bf16``: the values cast to that float type (``fp32`` is exact);
* ``raw``: integer tensors (token ids) byte for byte;
* ``int8``: blockwise absmax, one fp16 scale per block of ``block_size`` elements, 1 byte per value
  (fp32 scales for a tensor too large or too small for fp16 ones, so every finite tensor encodes, and
  small ones such as gradients with the same relative precision as any other);
* ``int4``: the same with 15 levels, two values per byte;
* ``int4_rot``: ``int4`` after a seeded randomised Hadamard rotation of every block, which tames
  outliers; only the seed travels;
* ``int3_rot``: ``int4_rot``'s layout with 7 levels (-3..3) instead of 15: the same plain bytes, but
  codes of one bit less information, so it pays only zstd-coded (``swarm.wire.entropy``), where it
  sends 30-47% fewer bytes than ``int4_rot`` at 2.3x its error (docs/codecs.md, "int3_rot");
* ``lowrank``: the tensor as a matrix of rows of its last dimension, sent as two thin int8 factors of
  ``rank`` columns (``swarm.wire.lowrank``): ``(rows + columns) x rank`` bytes instead of one per value,
  and an error that depends on how much of the matrix's energy those directions hold, not on a bit width;
* ``ecsq``: one quantisation step for the whole tensor, int8 codes meant to travel entropy-coded by rows
  (``swarm.wire.ecsq``, ``swarm.wire.row_coding``): small values cost few bits and no per-block scale
  travels; for gradients, whose magnitudes vary from token to token, with the error feedback it needs
  (docs/codecs.md, "ecsq").

See ``docs/codecs.md`` for the layout, the error bound of each codec and measured speed;
``swarm.wire.error_feedback.ErrorFeedback`` keeps the quantisation error of gradients from accumulating.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

from swarm.config import DEFAULT_WIRE_RANK
from swarm.wire import bytes_out, ecsq, lowrank, quantize
from swarm.wire.hadamard import BlockRotation, is_power_of_two

FLOAT_CODECS = ("fp32", "fp16", "bf16")
QUANT_CODECS = ("int8", "int4", "int4_rot", "int3_rot")
ROTATED_CODECS = frozenset({"int4_rot", "int3_rot"})
LOSSY_CODECS = (*QUANT_CODECS, "lowrank", "ecsq")
CODEC_NAMES = (*FLOAT_CODECS, "raw", *LOSSY_CODECS)
DEFAULT_RANK = DEFAULT_WIRE_RANK
RAW_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32)
DECODED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 1 << 16
MAX_SEED = (1 << 64) - 1
FP16_MAX = float(torch.finfo(torch.float16).max)

_STORAGE_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"int8": 8, "int4": 4, "int4_rot": 4, "int3_rot": 4}  # bits per value in the payload
_LEVELS = {"int8": 127, "int4": 7, "int4_rot": 7, "int3_rot": 3}  # largest |code|


class CodecError(ValueError):
    """Input that a codec refuses: non-finite values, inconsistent payloads, absurd shapes."""


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as it travels: codec name, decoded shape and dtype, and the bytes.

    ``scales``, ``block_size`` and ``seed`` are used by the integer codecs only (empty / 0 otherwise),
    ``rank`` by ``lowrank`` only.
    """

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload: bytes
    scales: bytes = b""
    block_size: int = 0
    seed: int = 0
    rank: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.payload) + len(self.scales)


def numel_of(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise CodecError(f"negative dimension in shape {shape}")
        n *= d
    return n


_to_bytes = bytes_out.tensor_bytes


def _cast_to_bytes(x: torch.Tensor, storage: torch.dtype) -> bytes:
    """``x`` converted to ``storage`` and laid out as bytes in one pass (no converted tensor in between)."""
    x = x.detach().reshape(-1)
    data, view = bytes_out.new_bytes(x.numel() * storage.itemsize)
    if view is None:
        return _to_bytes(x.to(storage))
    view.view(storage).copy_(x)
    return data


_frombuffer_warning_consumed = False


def _from_bytes(data: bytes, dtype: torch.dtype, count: int) -> torch.Tensor:
    """A view of ``data`` as ``count`` values of ``dtype``, without copying; callers only read it.

    torch warns that a tensor over immutable ``bytes`` is writable in principle. It emits that warning
    once per process; the first call here consumes it silently, since the codecs never write to the
    view (copying 16 MB per decode just to avoid the message would cost ~5% of int8 decode time).
    """
    global _frombuffer_warning_consumed
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if _frombuffer_warning_consumed:
        return torch.frombuffer(data, dtype=dtype, count=count)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        view = torch.frombuffer(data, dtype=dtype, count=count)
    _frombuffer_warning_consumed = True
    return view


def _all_finite(x: torch.Tensor) -> bool:
    """True when ``x`` holds no NaN/Inf; min and max propagate NaN, so one pass and no mask tensor."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _surely_below_fp16_scales(scales32: torch.Tensor) -> bool:
    """Would fp16 scales (a larger floor, rounded up to fp16) have stayed below ``FP16_SCALE_MIN`` too?

    The bound is loose (one fp16 subnormal step and twice fp16's rounding on top of the fp32 scales), so
    it never says yes where the fp16 pass would have chosen fp16; near the line the caller asks that pass.
    """
    if not scales32.numel():
        return False
    top = float(scales32.max())
    return math.isfinite(top) and (top + 2.0**-24) * (1.0 + 2.0**-9) < quantize.FP16_SCALE_MIN


def check_block_size(codec: str, block_size: object) -> int:
    """Validate the block size of an integer codec (before any arithmetic uses it); returns its bit width."""
    bits = _BITS[codec]
    if type(block_size) is not int or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(f"block size {block_size!r} for codec {codec} must be an integer in [1, {MAX_BLOCK_SIZE}]")
    if bits == 4 and block_size % 2:
        raise CodecError(f"block size {block_size} for codec {codec} must be even (two values per byte)")
    if codec in ROTATED_CODECS and not is_power_of_two(block_size):
        raise CodecError(f"block size {block_size} for codec {codec} must be a power of two (Hadamard)")
    return bits


def _check_quant_params(codec: str, block_size: object, seed: object) -> int:
    """Validate block size and seed of an integer codec; returns its bit width."""
    bits = check_block_size(codec, block_size)
    if type(seed) is not int or not 0 <= seed <= MAX_SEED:
        raise CodecError(f"seed {seed!r} must be an unsigned 64-bit integer")
    return bits


def encode(
    x: torch.Tensor,
    codec: str,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    allow_nonfinite: bool = False,
    small: bool = False,
    rank: int = DEFAULT_RANK,
    reference_rms: float | None = None,
) -> EncodedTensor:
    """Encode ``x`` with ``codec``; refuses NaN/Inf unless allowed (a broken peer must not spread them).

    ``block_size`` and ``seed`` matter only to the integer codecs. ``small`` says that ``x`` is probably
    too small for fp16 scales (gradients w.r.t. hidden states, ~1e-7): the integer codecs then quantise
    with fp32 scales first and mostly need one pass instead of two; the bytes are the same either way.
    The integer codecs cannot represent NaN/Inf at all (their scales must be finite), so they refuse
    non-finite input even with ``allow_nonfinite``.
    The decoded tensor will have ``x.dtype``, which must be float32, float16 or bfloat16 for every
    codec but ``raw``. ``rank`` is ``lowrank``'s (capped at the matrix's smaller side). ``reference_rms``:
    ``x`` is a change to a tensor of that rms, and ``ecsq`` sets its step from it (``swarm.wire.ecsq``).
    """
    shape = tuple(x.shape)
    if codec == "raw":
        if x.dtype not in RAW_DTYPES:
            raise CodecError(f"raw codec does not carry dtype {x.dtype}")
        return EncodedTensor("raw", shape, x.dtype, _to_bytes(x))
    if codec not in _STORAGE_DTYPE and codec not in _BITS and codec not in ("lowrank", "ecsq"):
        raise CodecError(f"unknown codec {codec!r}; known: {', '.join(CODEC_NAMES)}")
    if x.dtype not in DECODED_FLOAT_DTYPES:
        raise CodecError(f"codec {codec} needs a float32, float16 or bfloat16 tensor, got {x.dtype}")
    if codec in _STORAGE_DTYPE:
        if not allow_nonfinite and not _all_finite(x):
            raise CodecError("tensor contains NaN or Inf")
        if codec == "fp16" and not allow_nonfinite and x.numel() and float(x.detach().abs().max()) > FP16_MAX:
            raise CodecError(
                f"values beyond fp16's range (absmax {float(x.detach().abs().max()):.3g} > {FP16_MAX:g}) "
                "would arrive as Inf; use bf16, fp32 or an integer codec for this direction"
            )
        return EncodedTensor(codec, shape, x.dtype, _cast_to_bytes(x, _STORAGE_DTYPE[codec]))
    if codec == "lowrank":
        return _encode_lowrank(x, block_size, seed, rank)
    if codec == "ecsq":
        return _encode_ecsq(x, reference_rms)
    bits = _check_quant_params(codec, block_size, seed)
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rotation = BlockRotation(seed, block_size, flat.device) if codec in ROTATED_CODECS else None
    # On CPU the payload is written straight into the bytes that travel (no tensor, then a copy).
    data, view = bytes_out.new_bytes(quantize.payload_nbytes(flat.numel(), bits)) if flat.is_cpu else (b"", None)
    out = None if view is None else view.view(torch.int8) if bits == 8 else view
    levels = _LEVELS[codec]
    quantise = functools.partial(quantize.quantize, flat, bits, block_size, rotation, payload=out, levels=levels)
    payload, scales = None, None
    if small:  # fp32 scales first; kept where fp16 ones would surely have been too small (the rule below)
        payload, scales = quantise(torch.float32)
        if not _surely_below_fp16_scales(scales):
            payload, scales = None, None
    if scales is None:
        payload, scales = quantise()
        if scales.numel() and not bool(torch.isfinite(scales).all()):
            if not _all_finite(flat):
                raise CodecError(f"tensor contains NaN or Inf, which codec {codec} cannot represent")
            # too large for fp16 scales (int4 near 4.6e5): the same layout with fp32 scales, exact in range
            payload, scales = quantise(torch.float32)
        elif scales.numel() and float(scales.max()) < quantize.FP16_SCALE_MIN:
            # too small for fp16 scales (gradients, ~1e-7): fp32 ones keep their precision, 2 bytes per block more
            payload, scales = quantise(torch.float32)
    if view is None:
        data = _to_bytes(payload)
    del payload, out, view  # nothing may write into ``data`` once it is shared
    return EncodedTensor(
        codec,
        shape,
        x.dtype,
        data,
        scales=_to_bytes(scales),
        block_size=block_size,
        seed=seed if codec in ROTATED_CODECS else 0,
    )


def _check_rank(rank: object, shape: tuple[int, ...]) -> int:
    """``rank`` as ``lowrank`` may carry it for ``shape``: at least 1 (0 for an empty tensor), at most the
    matrix's smaller side."""
    m, n = quantize.matrix_shape(shape)
    top = min(m, n, lowrank.MAX_RANK)
    if type(rank) is not int or not (1 if top else 0) <= rank <= top:
        raise CodecError(f"rank {rank!r} of a lowrank {m} x {n} matrix must be an integer in [1, {top}]")
    return rank


def _encode_lowrank(x: torch.Tensor, block_size: object, seed: object, rank: object) -> EncodedTensor:
    check_block_size("int8", block_size)
    if type(seed) is not int or not 0 <= seed <= MAX_SEED:
        raise CodecError(f"seed {seed!r} must be an unsigned 64-bit integer")
    if type(rank) is not int or rank < 1:
        raise CodecError(f"rank {rank!r} must be a positive integer")
    shape = tuple(x.shape)
    if not _all_finite(x):
        raise CodecError("tensor contains NaN or Inf, which codec lowrank cannot represent")
    r = lowrank.effective_rank(min(rank, lowrank.MAX_RANK), shape)
    payload, scales = lowrank.encode(x, r, seed, block_size) if r else (torch.empty(0, dtype=torch.int8),) * 2
    if r and not bool(torch.isfinite(scales).all()):  # factors beyond float32: nothing the receiver could use
        raise CodecError("tensor too large for codec lowrank's factors")
    return EncodedTensor(
        "lowrank", shape, x.dtype, _to_bytes(payload), scales=_to_bytes(scales), block_size=block_size, rank=r
    )


def _decode_lowrank(enc: EncodedTensor, device: torch.device | str | None) -> torch.Tensor:
    check_block_size("int8", enc.block_size)
    if enc.dtype not in DECODED_FLOAT_DTYPES:
        raise CodecError(f"codec lowrank cannot decode to {enc.dtype}")
    r = _check_rank(enc.rank, enc.shape)
    pn, qn, pb, qb = lowrank.sizes(r, enc.shape, enc.block_size)
    if len(enc.payload) != pn + qn:
        raise CodecError(
            f"payload of {len(enc.payload)} bytes does not match shape {list(enc.shape)} with codec lowrank "
            f"of rank {r} ({pn + qn} bytes expected)"
        )
    if len(enc.scales) != 4 * (pb + qb):
        raise CodecError(
            f"scales of {len(enc.scales)} bytes do not match {pb + qb} blocks of {enc.block_size} elements "
            f"({4 * (pb + qb)} bytes of fp32 expected)"
        )
    scales = _from_bytes(enc.scales, torch.float32, pb + qb)
    if pb + qb and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise CodecError("codec lowrank message has a negative, NaN or infinite scale")
    target = torch.device(device) if device is not None else torch.device("cpu")
    if not r:
        return torch.zeros(enc.shape, dtype=enc.dtype, device=target)
    payload = _from_bytes(enc.payload, torch.int8, pn + qn)
    return lowrank.decode(payload, scales, enc.shape, r, enc.block_size, enc.dtype, target)


def _encode_ecsq(x: torch.Tensor, reference_rms: float | None = None) -> EncodedTensor:
    flat = x.detach().reshape(-1)
    lo, hi = torch.aminmax(flat) if flat.numel() else (torch.zeros(()), torch.zeros(()))
    lo, hi = float(lo), float(hi)  # one pass: the finiteness check and the absmax the step needs
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise CodecError("tensor contains NaN or Inf, which codec ecsq cannot represent")
    step = ecsq.step_of(flat, max(-lo, hi), reference_rms)
    if step > ecsq.MAX_STEP:
        raise CodecError(f"values too large for codec ecsq (step {step:.3g} > {ecsq.MAX_STEP:.3g})")
    data, view = bytes_out.new_bytes(flat.numel()) if flat.is_cpu else (b"", None)
    if step == 0.0:  # empty or all zeros: every code is 0
        codes = torch.zeros(flat.numel(), dtype=torch.int8) if view is None else view.zero_()
    else:
        codes = ecsq.encode(flat, step, None if view is None else view.view(torch.int8))
    if view is None:
        data = _to_bytes(codes)
    del codes, view  # nothing may write into ``data`` once it is shared
    return EncodedTensor("ecsq", tuple(x.shape), x.dtype, data, scales=_to_bytes(torch.tensor([step])))


def _decode_ecsq(enc: EncodedTensor, n: int, device: torch.device | str | None) -> torch.Tensor:
    if enc.dtype not in DECODED_FLOAT_DTYPES:
        raise CodecError(f"codec ecsq cannot decode to {enc.dtype}")
    if enc.block_size or enc.seed or enc.rank:
        raise CodecError("codec ecsq carries no block size, seed or rank")
    if len(enc.payload) != n:
        raise CodecError(
            f"payload of {len(enc.payload)} bytes does not match shape {list(enc.shape)} with codec ecsq "
            f"({n} bytes expected)"
        )
    if len(enc.scales) != 4:
        raise CodecError(f"codec ecsq carries its step as one fp32 (4 bytes), got {len(enc.scales)} bytes")
    step = float(_from_bytes(enc.scales, torch.float32, 1)[0])
    if not 0.0 <= step <= ecsq.MAX_STEP:  # also refuses NaN
        raise CodecError(f"codec ecsq message has step {step!r}; it must be finite, in [0, {ecsq.MAX_STEP:.3g}]")
    target = torch.device(device) if device is not None else torch.device("cpu")
    codes = _from_bytes(enc.payload, torch.int8, n)
    return ecsq.decode(codes, step, enc.dtype, target).reshape(enc.shape)


def decode(
    enc: EncodedTensor, *, max_elements: int = 1 << 28, device: torch.device | str | None = None
) -> torch.Tensor:
    """Decode after checking that payload and scales match shape, codec and block size exactly.

    Every size check is arithmetic on the header, done before any tensor is allocated; received scales
    are checked finite (and non-negative) before the output is allocated.
    """
    n = numel_of(enc.shape)
    if n > max_elements:
        raise CodecError(f"tensor of {n} elements exceeds the limit of {max_elements}")
    if enc.codec in _BITS:
        return _decode_quantised(enc, n, device)
    if enc.codec == "lowrank":
        return _decode_lowrank(enc, device)
    if enc.codec == "ecsq":
        return _decode_ecsq(enc, n, device)
    if enc.codec == "raw":
        if enc.dtype not in RAW_DTYPES:
            raise CodecError(f"raw codec does not carry dtype {enc.dtype}")
        storage = enc.dtype
    elif enc.codec in _STORAGE_DTYPE:
        if enc.dtype not in DECODED_FLOAT_DTYPES:
            raise CodecError(f"codec {enc.codec} cannot decode to {enc.dtype}")
        storage = _STORAGE_DTYPE[enc.codec]
    else:
        raise CodecError(f"unknown codec {enc.codec!r}; known: {', '.join(CODEC_NAMES)}")
    if enc.scales:
        raise CodecError(f"codec {enc.codec} carries no scales, got {len(enc.scales)} bytes")
    expected = n * storage.itemsize
    if len(enc.payload) != expected:
        raise CodecError(
            f"payload of {len(enc.payload)} bytes does not match shape {list(enc.shape)} "
            f"with codec {enc.codec} ({expected} bytes expected)"
        )
    # Always copy out of the received bytes: the result must own writable memory.
    out = torch.empty(enc.shape, dtype=enc.dtype, device=device if device is not None else "cpu")
    return out.copy_(_from_bytes(enc.payload, storage, n).reshape(enc.shape))


def _decode_quantised(enc: EncodedTensor, n: int, device: torch.device | str | None) -> torch.Tensor:
    bits = _check_quant_params(enc.codec, enc.block_size, enc.seed)
    if enc.dtype not in DECODED_FLOAT_DTYPES:
        raise CodecError(f"codec {enc.codec} cannot decode to {enc.dtype}")
    nblocks = quantize.num_blocks(n, enc.block_size)
    expected = quantize.payload_nbytes(n, bits)
    if len(enc.payload) != expected:
        raise CodecError(
            f"payload of {len(enc.payload)} bytes does not match shape {list(enc.shape)} "
            f"with codec {enc.codec} ({expected} bytes expected)"
        )
    if len(enc.scales) == 2 * nblocks:
        scales = _from_bytes(enc.scales, torch.float16, nblocks).float()
    elif len(enc.scales) == 4 * nblocks:  # fp32 scales: a tensor too large for fp16 ones
        scales = _from_bytes(enc.scales, torch.float32, nblocks)
    else:
        raise CodecError(
            f"scales of {len(enc.scales)} bytes do not match {nblocks} blocks of {enc.block_size} "
            f"elements ({2 * nblocks} bytes of fp16 or {4 * nblocks} of fp32 expected)"
        )
    if nblocks and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise CodecError(f"codec {enc.codec} message has a negative, NaN or infinite scale")
    target = torch.device(device) if device is not None else torch.device("cpu")
    payload = _from_bytes(enc.payload, torch.int8 if bits == 8 else torch.uint8, expected)
    rotation = BlockRotation(enc.seed, enc.block_size, target) if enc.codec in ROTATED_CODECS else None
    flat = quantize.dequantize(payload, scales, n, bits, enc.block_size, enc.dtype, target, rotation)
    return flat.reshape(enc.shape)
