"""zstd-coded 4-bit payloads: lossless, smaller, and a hostile frame is refused before it can grow."""

import math
import subprocess
import tracemalloc
from pathlib import Path

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.pb import wire_pb2 as pb
from swarm.wire import entropy
from swarm.wire.codec_policy import WirePolicy
from swarm.wire.packets import WireError, tensor_from_pb, tensor_to_pb
from tests.conftest import ravn_cmd, read_metrics, run_ravn_local


def activations(seed: int = 0) -> torch.Tensor:
    """Hidden states with a few massive channels, as a trained GPT's are (their codes are far from uniform)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 128, 256, generator=g)
    x[..., :3] *= 30
    return x


def coded(x: torch.Tensor, codec: str = "int4_rot") -> pb.Tensor:
    return tensor_to_pb(x, codec, zstd=True, block_size=64, seed=7)


@pytest.mark.parametrize("codec", ["int4", "int4_rot", "int3_rot"])
def test_coded_payloads_decode_to_exactly_the_same_tensor_and_are_smaller(codec: str) -> None:
    x = activations()
    plain, z = tensor_to_pb(x, codec, block_size=64, seed=7), coded(x, codec)
    assert z.compression == pb.ZSTD and plain.compression == pb.COMPRESSION_NONE
    assert len(z.payload) < 0.95 * len(plain.payload)
    assert torch.equal(tensor_from_pb(z), tensor_from_pb(plain))


@pytest.mark.parametrize("small", [False, True], ids=["fp16 scales", "fp32 scales"])
def test_coded_scales_travel_as_byte_planes_and_decode_to_exactly_the_same_tensor(small: bool) -> None:
    """Scales are 15-20% of what int3_rot sends once its codes are coded; their high bytes (sign, exponent)
    take few values, so zstd over byte planes takes a quarter off fp16 scales, a sixth off fp32 ones."""
    x = activations() * (1e-7 if small else 1.0)  # gradients w.r.t. hidden states are ~1e-7: fp32 scales
    plain = tensor_to_pb(x, "int3_rot", block_size=64, seed=7, small=small)
    z = tensor_to_pb(x, "int3_rot", zstd=True, block_size=64, seed=7, small=small)
    nblocks = x.numel() // 64
    assert len(plain.scales) == (4 if small else 2) * nblocks
    assert z.scales_compression == pb.ZSTD_PLANES and plain.scales_compression == pb.COMPRESSION_NONE
    assert len(z.scales) < 0.9 * len(plain.scales)
    assert torch.equal(tensor_from_pb(z), tensor_from_pb(plain))


def test_scales_that_zstd_would_not_shrink_travel_raw() -> None:
    x = torch.randn(2, 64)  # two blocks: a frame's header alone outweighs four bytes of scales
    z = tensor_to_pb(x, "int3_rot", zstd=True, block_size=64, seed=7)
    assert z.compression == pb.ZSTD and z.scales_compression == pb.COMPRESSION_NONE and len(z.scales) == 4
    assert torch.equal(tensor_from_pb(z), tensor_from_pb(tensor_to_pb(x, "int3_rot", block_size=64, seed=7)))


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_other_codecs_travel_uncoded(codec: str) -> None:
    x = activations()
    assert coded(x, codec).compression == pb.COMPRESSION_NONE
    assert coded(x, codec).payload == tensor_to_pb(x, codec, block_size=64, seed=7).payload


def test_the_policy_codes_both_directions_when_asked() -> None:
    mb = pb.MicroBatch(id=3)
    grad = activations(1) * 1e-7
    for zstd in (False, True):
        policy = WirePolicy(forward="int4_rot", backward="int4_rot", zstd=zstd)
        fwd = policy.activations(mb, activations(), None).activations.hidden
        bwd = policy.gradients(mb, grad, to="up").gradients.grad
        want = pb.ZSTD if zstd else pb.COMPRESSION_NONE
        assert fwd.compression == want and bwd.compression == want
        assert torch.isfinite(policy.decode(bwd)).all()


def _with(msg: pb.Tensor, **fields) -> pb.Tensor:
    out = pb.Tensor()
    out.CopyFrom(msg)
    for k, v in fields.items():
        if k == "shape":
            del out.shape[:]
            out.shape.extend(v)
        else:
            setattr(out, k, v)
    return out


def _declaring(frame: bytes, size: int) -> bytes:
    """``frame`` with its header's content size rewritten (a frame that lies about what it holds)."""
    fhd = frame[4]
    at = 5 + (0 if fhd & 0x20 else 1) + (0, 1, 2, 4)[fhd & 3]  # after the window descriptor and dictionary id
    width = {1: 2, 2: 4, 3: 8}[fhd >> 6]  # RFC 8878: 2-byte sizes are stored minus 256
    value = size - 256 if width == 2 else size
    return frame[:at] + value.to_bytes(width, "little") + frame[at + width :]


def test_hostile_coded_payloads_are_refused_with_a_reason() -> None:
    z = coded(activations())
    n = len(zstandard.ZstdDecompressor().decompress(z.payload))
    int8 = coded(activations(), "int8")
    bad = {
        "unknown compression id": _with(z, compression=9),
        "is never zstd-coded": _with(int8, compression=pb.ZSTD),
        "not a zstd frame": _with(z, payload=b"\x00" * 64),
        "declares": _with(z, payload=_declaring(z.payload, n // 2)),
        "trailing data": _with(z, payload=z.payload + b"junk"),
        "corrupt|gave 0 bytes": _with(z, payload=z.payload[: len(z.payload) // 2]),
        "exceeds the limit": _with(z, shape=[1 << 20, 1 << 10]),
        "scales of a payload that is not zstd-coded": _with(int8, scales_compression=pb.ZSTD_PLANES),
        "unknown compression id 7 for the scales": _with(z, scales_compression=7),
        "the scales' frame is not a zstd frame": _with(z, scales=b"\x00" * 64),
        "the scales' frame declares": _with(z, scales=_declaring(z.scales, 3 * len(activations()[0, 0]))),
        "the scales' frame .*trailing data": _with(z, scales=z.scales + b"junk"),
        "block size 0": _with(z, block_size=0),
        "must be a power of two": _with(z, block_size=48),
    }
    for reason, msg in bad.items():
        with pytest.raises(WireError, match=reason):
            tensor_from_pb(msg)


def test_a_frame_that_declares_the_right_size_but_holds_more_stops_at_the_declared_size() -> None:
    """A zip bomb: a tiny frame of 64 MiB of zeros, relabelled as the payload of a small tensor (64 KiB of
    codes). The receiver must refuse it without ever holding the 64 MiB (traced: 0.1 MiB at its peak)."""
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
    small = coded(activations())
    size = len(zstandard.ZstdDecompressor().decompress(small.payload))
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            tensor_from_pb(_with(small, payload=_declaring(bomb, size)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_coded_scales_that_declare_the_right_size_but_hold_more_stop_at_the_declared_size() -> None:
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
    small = coded(activations())
    assert small.scales_compression == pb.ZSTD_PLANES
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            tensor_from_pb(_with(small, scales=_declaring(bomb, 2 * activations().numel() // 64)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096))
def test_any_bytes_as_coded_scales_give_a_tensor_or_a_wire_error(data: bytes) -> None:
    msg = _with(coded(torch.randn(64, 64)), scales=data, scales_compression=pb.ZSTD_PLANES)
    try:
        out = tensor_from_pb(msg)
    except WireError:
        return
    assert out.shape == (64, 64)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096))
def test_any_bytes_as_a_coded_payload_give_a_tensor_or_a_wire_error(data: bytes) -> None:
    msg = _with(coded(torch.randn(64, 64)), payload=data)
    try:
        out = tensor_from_pb(msg)
    except WireError:
        return
    assert out.shape == (64, 64)


def test_decompress_checks_the_size_it_was_told() -> None:
    frame = entropy.compress(b"ab" * 1000)
    assert entropy.decompress(frame, 2000) == b"ab" * 1000
    with pytest.raises(entropy.EntropyError):
        entropy.decompress(frame, 1999)


@pytest.mark.slow  # two whole swarms
def test_a_swarm_trains_identically_with_and_without_zstd_and_sends_fewer_bytes(tmp_path: Path) -> None:
    """Real peers, int4_rot both ways: the same losses step for step (lossless), fewer bytes on the wire."""
    runs = {}
    for setting in ("on", "off"):
        run_ravn_local(
            tmp_path,
            f"zstd-{setting}",
            *("--peers", "3", "--model", "gpt-tiny", "--steps", "4", "--eval-every", "0", "--eval-batches", "1"),
            *("--wire-forward", "int4_rot", "--wire-backward", "int4_rot", "--wire-zstd", setting),
        )
        metrics = read_metrics(tmp_path / f"zstd-{setting}")
        summary = next(m for m in metrics if m["kind"] == "summary")
        runs[setting] = ([m["loss"] for m in metrics if m["kind"] == "step"], summary)
    (on_losses, on), (off_losses, off) = runs["on"], runs["off"]
    assert len(on_losses) == 4 and on_losses == off_losses
    assert on["wire_zstd"] is True and off["wire_zstd"] is False
    assert on["wire_bytes"] < 0.97 * off["wire_bytes"], (on["wire_bytes"], off["wire_bytes"])


@pytest.mark.slow  # two whole swarms
def test_a_swarm_trains_with_int3_rot_and_sends_fewer_bytes_than_with_int4_rot(tmp_path: Path) -> None:
    """Real peers: int3_rot both ways trains (finite losses) and puts fewer bytes on the wire than int4_rot."""
    bytes_per_token = {}
    for codec in ("int4_rot", "int3_rot"):
        run_ravn_local(
            tmp_path,
            codec,
            *("--peers", "3", "--model", "gpt-tiny", "--steps", "4", "--eval-every", "0", "--eval-batches", "1"),
            *("--wire-forward", codec, "--wire-backward", codec),
        )
        metrics = read_metrics(tmp_path / codec)
        summary = next(m for m in metrics if m["kind"] == "summary")
        losses = [m["loss"] for m in metrics if m["kind"] == "step"]
        assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
        assert summary["wire_zstd"] is True
        bytes_per_token[codec] = summary["wire_bytes"]
    assert bytes_per_token["int3_rot"] < 0.9 * bytes_per_token["int4_rot"], bytes_per_token


def test_int3_rot_without_zstd_is_a_one_line_error(tmp_path: Path) -> None:
    """Plain, int3_rot is int4_rot's size at twice its error: refused before anything starts."""
    for direction in ("--wire-forward", "--wire-backward"):
        proc = subprocess.run(
            ravn_cmd("local", "--runs-dir", str(tmp_path), direction, "int3_rot", "--wire-zstd", "off"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "error: codec int3_rot pays only entropy-coded (plain, it is int4_rot's size); drop --wire-zstd off"
        ]
        assert not any(tmp_path.iterdir())  # no run started
