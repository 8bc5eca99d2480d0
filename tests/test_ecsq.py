"""Codec ``ecsq``: one step per tensor, int8 codes, entropy-coded by rows on the wire (swarm/wire/ecsq.py)."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.pb import wire_pb2 as pb
from swarm.wire import ecsq, packets
from swarm.wire.codec_policy import WirePolicy, feeds_back
from swarm.wire.codecs import CodecError, decode, encode
from swarm.wire.error_feedback import ErrorFeedback
from tests.conftest import ravn_cmd, read_metrics, run_ravn_local

FAST = settings(max_examples=60, deadline=None)


def step_of(enc) -> float:
    return float(torch.frombuffer(bytearray(enc.scales), dtype=torch.float32)[0])


def token_gradients(tokens: int, width: int, seed: int, decades: float = 3.0) -> torch.Tensor:
    """Rows (tokens) of Gaussian values whose magnitudes spread over ``decades`` orders, as gradients' do."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (-7 - decades * torch.rand(tokens, 1, generator=g))
    return torch.randn(tokens, width, generator=g) * magnitude


@FAST
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    magnitude=st.sampled_from([1e-30, 1e-7, 1.0, 1e4, 1e30]),
    kind=st.sampled_from(["randn", "heavy", "sparse", "const"]),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_every_value_comes_back_within_half_a_step(shape, magnitude, kind, seed, dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "heavy":
        x = x / torch.randn(shape, generator=g).abs().clamp_min(1e-3)
    elif kind == "sparse":
        x = x * (torch.rand(shape, generator=g) < 0.1)
    elif kind == "const":
        x = torch.full(shape, -1.5)
    x = (x * magnitude).to(dtype)
    if not bool(torch.isfinite(x).all()):  # fp16 overflow of a huge magnitude: not this test's input
        return
    enc = encode(x, "ecsq")
    y = decode(enc)
    assert y.dtype == dtype and y.shape == x.shape and len(enc.payload) == x.numel() and len(enc.scales) == 4
    step, xf = step_of(enc), x.float()
    absmax = float(xf.abs().max())
    rms = float(torch.linalg.vector_norm(xf, dtype=torch.float64)) / math.sqrt(xf.numel())
    if absmax == 0.0:
        assert step == 0.0 and not y.any()
        return
    expected = max(ecsq.STEP_PER_RMS * rms, absmax / ecsq.LEVEL, ecsq.MIN_STEP)
    assert step == pytest.approx(expected, rel=1e-6)
    # the decoded value is rounded once more into the output dtype: relatively, and by half a subnormal step below
    out_eps = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    out_tiny = {torch.float32: 0.0, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}[dtype]
    bound = step / 2 * (1 + 1e-5) + (absmax + step) * out_eps + out_tiny
    assert float((y.float() - xf).abs().max()) <= bound


def test_on_gaussian_data_its_error_is_int3_rots() -> None:
    x = torch.randn(4, 128, 256, generator=torch.Generator().manual_seed(1))
    err = {c: float((decode(encode(x, c)) - x).norm() / x.norm()) for c in ("ecsq", "int3_rot")}
    assert err["ecsq"] == pytest.approx(err["int3_rot"], abs=0.01)


def test_on_tokens_of_spread_magnitudes_it_sends_fewer_bytes_at_less_error_than_int3_rot() -> None:
    """What the codec is for: gradients whose rows differ in magnitude (both sent zstd-coded, as the wire does)."""
    x = token_gradients(512, 256, seed=3)
    sizes, errors = {}, {}
    for codec in ("ecsq", "int3_rot"):
        msg = packets.tensor_to_pb(x, codec, zstd=True, **({} if codec == "ecsq" else {"seed": 5}))
        sizes[codec] = len(msg.payload) + len(msg.scales)
        errors[codec] = float((packets.tensor_from_pb(msg) - x).norm() / x.norm())
    assert errors["ecsq"] < errors["int3_rot"]
    assert sizes["ecsq"] < 0.8 * sizes["int3_rot"], sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("extra", [0, 1, 12345])
def test_tensors_over_a_chunk_code_as_the_one_pass_form_does(dtype: torch.dtype, extra: int) -> None:
    """On CPU a tensor larger than a chunk is streamed chunk by chunk: the same codes, values and step."""
    n = 3 * ecsq.CPU_CHUNK_ELEMS + extra
    x = (token_gradients(n // 64 + 1, 64, seed=extra).reshape(-1)[:n] * 1e6).to(dtype)
    flat = x.float()
    absmax = float(flat.abs().max())
    step = ecsq.step_of(x, absmax)
    rms = float(torch.linalg.vector_norm(flat, dtype=torch.float64)) / math.sqrt(n)
    assert step == float(torch.tensor(max(ecsq.STEP_PER_RMS * rms, absmax / ecsq.LEVEL), dtype=torch.float32))
    codes = ecsq.encode(x, step, None)
    assert torch.equal(codes, (flat * (1.0 / step)).round_().clamp_(-ecsq.LEVEL, ecsq.LEVEL).to(torch.int8))
    into = torch.empty(n, dtype=torch.int8)
    assert ecsq.encode(x, step, into) is into and torch.equal(into, codes)
    for out_dtype in (torch.float32, dtype):
        back = ecsq.decode(codes, step, out_dtype, torch.device("cpu"))
        assert back.dtype == out_dtype and torch.equal(back, (codes.float() * step).to(out_dtype))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = torch.randn(100)
    x[7] = bad
    for allow in (False, True):
        with pytest.raises(CodecError, match="NaN or Inf"):
            encode(x, "ecsq", allow_nonfinite=allow)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_past_the_first_chunk_is_refused(bad: float) -> None:
    """A tensor of several chunks is checked whole, not only in its first chunk."""
    x = torch.randn(3 * ecsq.CPU_CHUNK_ELEMS + 5)
    x[2 * ecsq.CPU_CHUNK_ELEMS + 3] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        encode(x, "ecsq")


def test_values_whose_step_would_overflow_a_code_are_refused() -> None:
    with pytest.raises(CodecError, match="too large for codec ecsq"):
        encode(torch.full((10,), 3e38), "ecsq")
    y = decode(encode(torch.full((10,), 1e36), "ecsq"))  # just below: every code stays finite
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"payload": b""}, "payload of"),
        ({"shape": (8, 9)}, "payload of"),
        ({"scales": b""}, "4 bytes"),
        ({"scales": b"\0" * 8}, "4 bytes"),
        ({"block_size": 64}, "no block size"),
        ({"seed": 1}, "no block size"),
        ({"rank": 2}, "no block size"),
        ({"dtype": torch.int64}, "cannot decode"),
    ],
)
def test_malformed_messages_are_refused(change: dict, match: str) -> None:
    enc = encode(torch.randn(8, 10), "ecsq")
    with pytest.raises(CodecError, match=match):
        decode(dataclasses.replace(enc, **change))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 3e38])
def test_a_bad_step_is_refused(value: float) -> None:
    enc = encode(torch.randn(8, 10), "ecsq")
    scales = torch.tensor([value], dtype=torch.float32).numpy().tobytes()
    with pytest.raises(CodecError, match="step"):
        decode(dataclasses.replace(enc, scales=scales))


def test_any_code_a_stranger_writes_decodes_finite() -> None:
    enc = encode(torch.randn(256), "ecsq")
    step = torch.tensor([ecsq.MAX_STEP], dtype=torch.float32)
    worst = dataclasses.replace(enc, payload=bytes([0x80]) * 256, scales=step.numpy().tobytes())  # -128 each
    assert bool(torch.isfinite(decode(worst)).all())


def test_on_the_wire_the_codes_travel_row_coded_and_the_step_plain() -> None:
    x = token_gradients(64, 256, seed=4)
    msg = pb.Tensor.FromString(packets.tensor_to_pb(x, "ecsq", zstd=True).SerializeToString())
    assert (msg.codec, msg.compression, msg.scales_compression) == (pb.ECSQ, pb.ROWS, pb.COMPRESSION_NONE)
    assert len(msg.payload) < x.numel() // 2 and len(msg.scales) == 4
    y = packets.tensor_from_pb(msg)
    assert float((y - x).norm() / x.norm()) < 0.3
    plain = packets.tensor_to_pb(x, "ecsq")  # without coding: int8's size, still decodable
    assert plain.compression == pb.COMPRESSION_NONE and len(plain.payload) == x.numel()
    assert torch.equal(packets.tensor_from_pb(plain), y)


def test_the_wire_refuses_codes_of_another_shape_zstd_and_coded_scales() -> None:
    x = torch.randn(16, 64)
    msg = packets.tensor_to_pb(x, "ecsq", zstd=True)
    liar = pb.Tensor()
    liar.CopyFrom(msg)
    del liar.shape[:]
    liar.shape.extend([16, 65])  # the codes declare 16 rows of 64; the header now implies 16 of 65
    with pytest.raises(packets.WireError, match="declares 16 rows of 64; the header implies 16 of 65"):
        packets.tensor_from_pb(liar)
    liar.CopyFrom(msg)
    liar.compression = pb.ZSTD  # ecsq's codes are never zstd-coded
    with pytest.raises(packets.WireError, match="never zstd-coded"):
        packets.tensor_from_pb(liar)
    liar.CopyFrom(msg)
    liar.scales_compression = pb.ZSTD_PLANES
    with pytest.raises(packets.WireError, match="coded scales of a payload that is not zstd-coded"):
        packets.tensor_from_pb(liar)
    del liar.shape[:]
    liar.shape.extend([1 << 20, 1 << 20])
    liar.scales_compression = pb.COMPRESSION_NONE
    with pytest.raises(packets.WireError, match="exceeds the limit"):
        packets.tensor_from_pb(liar)


def test_error_feedback_telescopes_and_is_on_under_auto() -> None:
    assert feeds_back("auto", "ecsq") and not feeds_back("off", "ecsq")
    fb, sent, true = ErrorFeedback(), torch.zeros(32, 64), torch.zeros(32, 64)
    for i in range(20):
        g = token_gradients(32, 64, seed=10 + i)
        true += g
        sent += decode(fb.encode(g, "ecsq"))
    owed = fb.residual
    assert owed is not None
    assert torch.allclose(true - sent, owed, rtol=1e-4, atol=1e-12)  # only the last residual is missing
    policy = WirePolicy(forward="int3_rot", backward="ecsq", error_feedback="auto", zstd=True)
    grad = policy.gradients(pb.MicroBatch(id=3), token_gradients(32, 64, seed=1).view(2, 16, 64), to="up").gradients
    assert (grad.grad.codec, grad.grad.block_size, grad.grad.seed) == (pb.ECSQ, 0, 0)
    assert policy._feedback["up"].residual is not None and policy.sent == {"backward:ecsq": 1}


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (  # plain, ecsq is int8's size at eight times its error
            ("--wire-zstd", "off"),
            "error: codec ecsq pays only entropy-coded (plain, it is int8's size); drop --wire-zstd off",
        ),
        (  # without its residual ecsq drops small tokens' gradients every time (+12% by step 180 on gpt-medium)
            ("--error-feedback-backward", "off"),
            "error: gradients sent ecsq need error feedback (without it gpt-medium trained 12% worse); "
            "drop --error-feedback-backward off, or name another --wire-backward",
        ),
    ],
)
def test_the_command_line_refuses_ecsq_where_it_cannot_pay(tmp_path: Path, flag: tuple[str, str], message: str) -> None:
    proc = subprocess.run(
        ravn_cmd("local", "--runs-dir", str(tmp_path), "--wire-backward", "ecsq", *flag),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [message]
    assert not any(tmp_path.iterdir())  # no run started


@pytest.mark.slow  # three peer processes train a few steps: over 20 s on a shared machine
def test_a_swarm_trains_with_ecsq_gradients(tmp_path: Path) -> None:
    """``ravn local --wire-forward int3_rot --wire-backward ecsq``: real peers, real wire, error feedback on."""
    run_ravn_local(
        tmp_path,
        "ec",
        *("--peers", "3", "--model", "gpt-tiny", "--steps", "4", "--eval-every", "0", "--eval-batches", "1"),
        *("--wire-forward", "int3_rot", "--wire-backward", "ecsq"),
    )
    metrics = read_metrics(tmp_path / "ec")
    summary = next(m for m in metrics if m["kind"] == "summary")
    assert summary["steps"] == 4 and summary["final_val_loss"] is not None
    sent = {s["stage"]: s["sent_codecs"] for s in summary["stages"]}
    assert set(sent[0]) == {"forward:int3_rot"} and set(sent[2]) == {"backward:ecsq"}
    assert set(sent[1]) == {"forward:int3_rot", "backward:ecsq"}
    logs = " ".join(p.read_text() for p in (tmp_path / "ec" / "logs").glob("peer-*.log"))
    assert re.search(r"error feedback on", logs)  # 'auto' turns it on for ecsq gradients
