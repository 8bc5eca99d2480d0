"""Tensor <-> protobuf, and packets <-> frames under gRPC's message size limit.

Everything a peer receives is untrusted: the header is checked (known dtype and codec, sane shape,
element limit) before the codec allocates anything. Packets are serialised once and cut into frames;
the receiver reassembles them with a hard cap on the total size, so a sender cannot make it buffer
without bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from swarm.pb import wire_pb2 as pb
from swarm.wire import codecs, entropy, row_coding
from swarm.wire.quantize import matrix_shape, num_blocks, payload_nbytes

MAX_FRAME_BYTES = 1 << 20  # well under gRPC's default 4 MiB message limit
DEFAULT_MAX_PACKET_BYTES = 512 << 20
DEFAULT_MAX_ELEMENTS = 1 << 27
MAX_DIMS = 8
ROW_CODED = frozenset({"ecsq"})  # codecs whose codes travel row-coded (Compression ROWS) when the run allows

_DTYPE_TO_PB = {
    torch.float32: pb.FLOAT32,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.int64: pb.INT64,
    torch.int32: pb.INT32,
    torch.int16: pb.INT16,
    torch.uint8: pb.UINT8,
}
_PB_TO_DTYPE = {v: k for k, v in _DTYPE_TO_PB.items()}
_CODEC_TO_PB = {
    "fp32": pb.FP32,
    "fp16": pb.FP16,
    "bf16": pb.BF16,
    "int8": pb.INT8,
    "int4": pb.INT4,
    "int4_rot": pb.INT4_ROT,
    "int3_rot": pb.INT3_ROT,
    "raw": pb.RAW,
    "lowrank": pb.LOWRANK,
    "ecsq": pb.ECSQ,
}
_PB_TO_CODEC = {v: k for k, v in _CODEC_TO_PB.items()}


class WireError(ValueError):
    """A message from the wire that cannot be accepted; the text says what was wrong."""


def codec_to_pb(name: str) -> int:
    try:
        return _CODEC_TO_PB[name]
    except KeyError:
        raise WireError(f"unknown codec {name!r}; known: {', '.join(_CODEC_TO_PB)}") from None


def codec_from_pb(value: int) -> str:
    try:
        return _PB_TO_CODEC[value]
    except KeyError:
        raise WireError(f"unknown codec id {value}") from None


def tensor_to_pb(x: torch.Tensor, codec: str, *, zstd: bool = False, **codec_options: object) -> pb.Tensor:
    """Encode ``x`` with ``codec`` into a wire Tensor; ``zstd``: code 4-bit payloads losslessly on top."""
    try:
        enc = codecs.encode(x, codec, **codec_options)
    except codecs.CodecError as e:
        raise WireError(str(e)) from e
    return encoded_to_pb(enc, zstd=zstd)


def encoded_to_pb(enc: codecs.EncodedTensor, *, zstd: bool = False) -> pb.Tensor:
    """The wire Tensor of ``enc``; ``zstd``: lossless coding on top where the codec has one (zstd for the 4-bit
    codecs' payloads and scales, row coding for ecsq's codes)."""
    coded = zstd and entropy.worth_coding(enc.codec)
    rows = zstd and enc.codec in ROW_CODED
    scales = None
    if coded:
        scales = entropy.compress_planes(enc.scales, num_blocks(codecs.numel_of(enc.shape), enc.block_size))
    if rows:
        payload = row_coding.compress(np.frombuffer(enc.payload, dtype=np.int8), matrix_shape(enc.shape)[1])
    else:
        payload = entropy.compress(enc.payload) if coded else enc.payload
    return pb.Tensor(
        shape=list(enc.shape),
        dtype=_DTYPE_TO_PB[enc.dtype],
        codec=codec_to_pb(enc.codec),
        payload=payload,
        scales=enc.scales if scales is None else scales,
        block_size=enc.block_size,
        seed=enc.seed,
        compression=pb.ROWS if rows else pb.ZSTD if coded else pb.COMPRESSION_NONE,
        scales_compression=pb.COMPRESSION_NONE if scales is None else pb.ZSTD_PLANES,
        rank=enc.rank,
    )


def _coded_numel(codec: str, coding: str, shape: tuple[int, ...], max_elements: int) -> int:
    """The element count of a tensor coded with ``coding``, once its codec may be and the count is in bounds."""
    coded = ROW_CODED if coding == "row-coded" else entropy.CODED
    if codec not in coded:
        raise WireError(f"codec {codec} is never {coding}; only {', '.join(sorted(coded))} are")
    n = codecs.numel_of(shape)
    if n > max_elements:
        raise WireError(f"tensor of {n} elements exceeds the limit of {max_elements}")
    return n


def _payload(msg: pb.Tensor, codec: str, shape: tuple[int, ...], max_elements: int) -> bytes:
    """The codec's payload, decoded when coded: bounded by the size the header implies."""
    if msg.compression == pb.COMPRESSION_NONE:
        return msg.payload
    if msg.compression == pb.ROWS:
        n = _coded_numel(codec, "row-coded", shape, max_elements)
        try:
            return row_coding.decompress(msg.payload, n, matrix_shape(shape)[1])
        except row_coding.RowCodingError as e:
            raise WireError(str(e)) from e
    if msg.compression != pb.ZSTD:
        raise WireError(f"unknown compression id {msg.compression}")
    n = _coded_numel(codec, "zstd-coded", shape, max_elements)
    try:
        return entropy.decompress(msg.payload, payload_nbytes(n, 4))
    except entropy.EntropyError as e:
        raise WireError(str(e)) from e


def _scales(msg: pb.Tensor, codec: str, shape: tuple[int, ...], max_elements: int) -> bytes:
    """The codec's scales, decompressed when coded: 2 or 4 bytes per block of the header, never more."""
    if msg.scales_compression == pb.COMPRESSION_NONE:
        return msg.scales
    if msg.scales_compression != pb.ZSTD_PLANES:
        raise WireError(f"unknown compression id {msg.scales_compression} for the scales")
    if msg.compression != pb.ZSTD:
        raise WireError("coded scales of a payload that is not zstd-coded")
    n = _coded_numel(codec, "zstd-coded", shape, max_elements)
    try:
        codecs.check_block_size(codec, msg.block_size)  # before num_blocks divides by it
        return entropy.decompress_planes(msg.scales, num_blocks(n, msg.block_size))
    except (codecs.CodecError, entropy.EntropyError) as e:
        raise WireError(str(e)) from e


def tensor_from_pb(
    msg: pb.Tensor,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Validate the header, then decode. Raises WireError with a reason a human can act on."""
    if len(msg.shape) > MAX_DIMS:
        raise WireError(f"tensor has {len(msg.shape)} dimensions; at most {MAX_DIMS} are accepted")
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"negative dimension in shape {list(shape)}")
    if msg.dtype not in _PB_TO_DTYPE:
        raise WireError(f"unknown or unset dtype id {msg.dtype}")
    dtype = _PB_TO_DTYPE[msg.dtype]
    if expect_shape is not None and shape != tuple(expect_shape):
        raise WireError(f"shape {list(shape)} does not match the expected {list(expect_shape)}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise WireError(f"dtype {dtype} does not match the expected {expect_dtype}")
    codec = codec_from_pb(msg.codec)
    enc = codecs.EncodedTensor(
        codec=codec,
        shape=shape,
        dtype=dtype,
        payload=_payload(msg, codec, shape, max_elements),
        scales=_scales(msg, codec, shape, max_elements),
        block_size=msg.block_size,
        seed=msg.seed,
        rank=msg.rank,
    )
    try:
        return codecs.decode(enc, max_elements=max_elements, device=device)
    except codecs.CodecError as e:
        raise WireError(str(e)) from e


def split_packet(packet: Message, packet_id: int, frame_bytes: int = MAX_FRAME_BYTES) -> Iterator[pb.Frame]:
    """Serialise once and yield frames of at most ``frame_bytes`` payload each."""
    data = packet.SerializeToString()
    total = len(data)
    if total <= frame_bytes:  # one frame (most activations and gradients): the serialised bytes as they are
        yield pb.Frame(packet_id=packet_id, data=data, last=True, total_size=total)
        return
    view = memoryview(data)
    for i, off in enumerate(range(0, total, frame_bytes)):
        yield pb.Frame(
            packet_id=packet_id,
            data=bytes(view[off : off + frame_bytes]),
            last=off + frame_bytes >= total,
            total_size=total if i == 0 else 0,
        )


@dataclass
class Reassembler:
    """Collects consecutive frames into packets, refusing anything over ``max_packet_bytes``."""

    max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES
    message_type: type[Message] = pb.Packet
    _id: int | None = None
    _expected: int = 0
    _parts: list[bytes] | None = None
    _size: int = 0

    def push(self, frame: pb.Frame) -> Message | None:
        """Feed one frame; returns a packet when its last frame arrives."""
        if self._parts is None:
            if frame.total_size > self.max_packet_bytes:
                raise WireError(f"packet of {frame.total_size} bytes exceeds the limit of {self.max_packet_bytes}")
            self._id, self._expected, self._parts, self._size = frame.packet_id, frame.total_size, [], 0
        elif frame.packet_id != self._id:
            raise WireError(f"frame of packet {frame.packet_id} interleaved into packet {self._id}")
        self._size += len(frame.data)
        if self._size > self._expected:
            raise WireError(f"packet {self._id} is larger than its announced {self._expected} bytes")
        self._parts.append(frame.data)
        if not frame.last:
            return None
        data, parts_size = b"".join(self._parts), self._size
        self._parts = None
        if parts_size != self._expected:
            raise WireError(f"packet {self._id} truncated: {parts_size} of {self._expected} bytes")
        packet = self.message_type()
        try:
            packet.ParseFromString(data)
        except DecodeError as e:
            raise WireError(f"malformed packet {self._id}: {e}") from e
        return packet
