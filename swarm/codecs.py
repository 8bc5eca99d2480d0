"""Tensor codecs for the wire: turn a tensor into bytes (and back) as cheaply as the link needs.

The network, not compute, is the bottleneck of a home-internet swarm, so every byte on the wire goes
through a codec chosen per direction (activations forward, gradients backward). Codecs are pure torch:
they know nothing of protobuf or gRPC (``swarm.wire`` maps an ``EncodedTensor`` onto the wire message).
Decoding validates sizes before allocating anything, because the bytes come from strangers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_CODECS = ("fp32", "fp16", "bf16")
CODEC_NAMES = (*FLOAT_CODECS, "raw")
RAW_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32)
DECODED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_STORAGE_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class CodecError(ValueError):
    """Input that a codec refuses: non-finite values, inconsistent payloads, absurd shapes."""


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as it travels: codec name, decoded shape and dtype, and the bytes."""

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload: bytes
    scales: bytes = b""
    block_size: int = 0
    seed: int = 0

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


def _to_bytes(x: torch.Tensor) -> bytes:
    return x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, count: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype, count=count)


def encode(x: torch.Tensor, codec: str, *, allow_nonfinite: bool = False) -> EncodedTensor:
    """Encode ``x`` with ``codec``; refuses NaN/Inf unless allowed (a broken peer must not spread them)."""
    shape = tuple(x.shape)
    if codec == "raw":
        if x.dtype not in RAW_DTYPES:
            raise CodecError(f"raw codec does not carry dtype {x.dtype}")
        return EncodedTensor("raw", shape, x.dtype, _to_bytes(x))
    if codec not in _STORAGE_DTYPE:
        raise CodecError(f"unknown codec {codec!r}; known: {', '.join(CODEC_NAMES)}")
    if not x.is_floating_point():
        raise CodecError(f"codec {codec} needs a floating-point tensor, got {x.dtype}")
    if not allow_nonfinite and not bool(torch.isfinite(x).all()):
        raise CodecError("tensor contains NaN or Inf")
    return EncodedTensor(codec, shape, x.dtype, _to_bytes(x.to(_STORAGE_DTYPE[codec])))


def decode(
    enc: EncodedTensor, *, max_elements: int = 1 << 28, device: torch.device | str | None = None
) -> torch.Tensor:
    """Decode after checking that the payload matches shape and codec exactly."""
    n = numel_of(enc.shape)
    if n > max_elements:
        raise CodecError(f"tensor of {n} elements exceeds the limit of {max_elements}")
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
    expected = n * storage.itemsize
    if len(enc.payload) != expected:
        raise CodecError(
            f"payload of {len(enc.payload)} bytes does not match shape {list(enc.shape)} "
            f"with codec {enc.codec} ({expected} bytes expected)"
        )
    out = _from_bytes(enc.payload, storage, n).reshape(enc.shape).to(enc.dtype)
    return out.to(device) if device is not None else out
