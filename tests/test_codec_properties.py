"""Property tests of every codec: round trips within the stated bound, and malformed input refused early.

The bounds are those of docs/codecs.md (checked by ``tests/test_codecs.py::assert_within_bound``, reused
here). Malformed ``EncodedTensor``s and ``pb.Tensor`` messages must raise ``CodecError`` / ``WireError``
before anything large is allocated: the tests claim shapes whose output could not be allocated at all
(2**40 elements and more) and measure with ``tracemalloc`` and the process's peak RSS that refusing
them cost next to nothing.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from swarm.pb import wire_pb2 as pb
from swarm.wire import packets
from swarm.wire.codecs import CODEC_NAMES, CodecError, EncodedTensor, decode, encode
from tests.test_codecs import assert_within_bound

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT = ("int8", "int4", "int4_rot", "int3_rot")
STORAGE_EPS = {"fp16": 2.0**-11, "bf16": 2.0**-8}
OUT_EPS = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple) | st.tuples(st.integers(0, 3000))
block_sizes = st.sampled_from([2, 4, 8, 16, 32, 64, 128, 256])


def _tensor(shape: tuple[int, ...], seed: int, magnitude: float, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * magnitude
    return x.clamp(-6e4, 6e4).to(dtype)


@FAST
@given(
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    codec=st.sampled_from(("fp32", "fp16", "bf16")),
)
def test_float_codecs_within_their_rounding(shape, seed, magnitude, dtype, codec):
    x = _tensor(shape, seed, magnitude, dtype)
    y = decode(encode(x, codec))
    assert y.shape == x.shape and y.dtype == x.dtype
    eps = STORAGE_EPS.get(codec, 0.0) + OUT_EPS[dtype]
    err = (y.float() - x.float()).abs()
    assert bool((err <= x.float().abs() * eps + 6e-8 * (eps > 0)).all())


@FAST
@given(
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.sampled_from([1e-4, 1.0, 1e3]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    codec=st.sampled_from(QUANT),
    block_size=block_sizes,
    rot_seed=st.integers(0, 2**64 - 1),
)
def test_integer_codecs_within_stated_bound(shape, seed, magnitude, dtype, codec, block_size, rot_seed):
    x = _tensor(shape, seed, magnitude, dtype)
    enc = encode(x, codec, block_size=block_size, seed=rot_seed)
    y = decode(enc)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_within_bound(x, enc, y)


def _valid(codec: str) -> EncodedTensor:
    options = {} if codec in ("fp32", "fp16", "bf16") else {"block_size": 64, "seed": 5}
    if codec == "raw":
        return encode(torch.arange(300, dtype=torch.int64), "raw")
    return encode(torch.randn(300), codec, **options)


@FAST
@given(codec=st.sampled_from(CODEC_NAMES), cut=st.integers(-40, 40).filter(bool), which=st.sampled_from(["p", "s"]))
def test_truncated_or_extended_payload_and_scales_refused(codec, cut, which):
    enc = _valid(codec)
    field = "payload" if which == "p" or not enc.scales else "scales"
    data = getattr(enc, field)
    data = data[:cut] if cut < 0 else data + bytes(cut)
    # scales carry no width field: fp16 and fp32 are told apart by length, so a cut that lands exactly on
    # the other width's length (5 blocks: 10 <-> 20 bytes) is a well-formed message, not a malformed one
    blocks = -(-300 // 64)
    assume(not (field == "scales" and len(data) in (2 * blocks, 4 * blocks)))
    with pytest.raises(CodecError):
        decode(dataclasses.replace(enc, **{field: data}))


@FAST
@given(codec=st.sampled_from(QUANT), value=st.sampled_from([float("nan"), float("inf"), -1.0, -float("inf")]))
def test_nan_or_negative_scales_refused(codec, value):
    enc = _valid(codec)
    scales = torch.frombuffer(bytearray(enc.scales), dtype=torch.float16).clone()
    scales[len(scales) // 2] = value
    with pytest.raises(CodecError, match="scale"):
        decode(dataclasses.replace(enc, scales=scales.numpy().tobytes()))


@FAST
@given(
    name=st.text(min_size=0, max_size=12).filter(lambda s: s not in CODEC_NAMES),
    pb_id=st.integers(max(pb.Codec.values()) + 1, 2**31 - 1),
)
def test_unknown_codec_names_and_ids_refused(name, pb_id):
    with pytest.raises(CodecError, match="unknown codec"):
        decode(dataclasses.replace(_valid("int8"), codec=name))
    with pytest.raises(CodecError, match="unknown codec"):
        encode(torch.zeros(3), name)
    msg = packets.tensor_to_pb(torch.randn(4), "fp32")
    msg.codec = pb_id
    with pytest.raises(packets.WireError, match="unknown codec id"):
        packets.tensor_from_pb(msg)


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


absurd_shapes = st.one_of(
    st.tuples(st.just(1 << 40)),
    st.tuples(st.integers(1 << 20, 1 << 31), st.integers(1 << 20, 1 << 31)),
    st.lists(st.integers(2, 1 << 16), min_size=3, max_size=6).filter(lambda s: math.prod(s) > 1 << 30).map(tuple),
)


@FAST
@given(shape=absurd_shapes, codec=st.sampled_from(CODEC_NAMES))
def test_absurd_shapes_refused_before_allocation(shape, codec):
    enc = dataclasses.replace(_valid(codec), shape=shape)
    rss = _peak_kib()
    tracemalloc.start()
    try:
        with pytest.raises(CodecError):
            decode(enc, max_elements=1 << 62)  # even with no element limit: the payload length decides
        with pytest.raises(CodecError, match="exceeds the limit"):
            decode(enc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # Python-side allocations: the messages, nothing sized by the shape
    assert _peak_kib() - rss < 64 << 10  # and no large tensor either (ru_maxrss is in KiB)


@FAST
@given(shape=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=4).filter(lambda s: min(s) < 0))
def test_negative_dimensions_refused(shape):
    with pytest.raises(CodecError, match="negative"):
        decode(dataclasses.replace(_valid("int8"), shape=tuple(shape)))
    msg = packets.tensor_to_pb(torch.randn(4), "int8")
    del msg.shape[:]
    msg.shape.extend(shape)
    with pytest.raises(packets.WireError, match="negative"):
        packets.tensor_from_pb(msg)


@FAST
@given(
    codec=st.sampled_from(CODEC_NAMES),
    dims=st.lists(st.integers(0, 1 << 40), min_size=0, max_size=10),
    payload_cut=st.integers(-8, 8),
    block_size=st.integers(0, 1 << 20),
    seed=st.integers(0, 2**64 - 1),
    dtype_id=st.integers(0, 12),
)
def test_malformed_pb_tensors_raise_wire_error_only(codec, dims, payload_cut, block_size, seed, dtype_id):
    """Any header a stranger can write either decodes to what it claims or raises WireError, quickly."""
    msg = packets.tensor_to_pb(torch.arange(64, dtype=torch.int64) if codec == "raw" else torch.randn(64), codec)
    del msg.shape[:]
    msg.shape.extend(dims)
    msg.dtype = dtype_id
    msg.block_size = block_size
    msg.seed = seed
    if payload_cut:
        msg.payload = msg.payload[:payload_cut] if payload_cut < 0 else msg.payload + bytes(payload_cut)
    try:
        y = packets.tensor_from_pb(msg)
    except packets.WireError:
        return
    assert tuple(y.shape) == tuple(dims)
    if codec == "lowrank":  # (m + n) x rank codes make an m x n matrix: at most (codes / 2)**2 values
        assert y.numel() <= (len(msg.payload) / 2) ** 2
    else:
        assert y.numel() * y.element_size() <= 64 * 8


def test_pb_round_trip_of_every_codec_and_dtype():
    for codec in CODEC_NAMES:
        for dtype in (torch.int64, torch.int32) if codec == "raw" else FLOAT_DTYPES:
            x = torch.arange(130, dtype=dtype).reshape(10, 13) if codec == "raw" else torch.randn(10, 13).to(dtype)
            msg = pb.Tensor.FromString(packets.tensor_to_pb(x, codec).SerializeToString())
            y = packets.tensor_from_pb(msg, expect_shape=(10, 13), expect_dtype=dtype)
            assert y.dtype == dtype and y.shape == x.shape
            y.add_(1)  # the decoded tensor owns writable memory
