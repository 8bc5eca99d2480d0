"""The ``lowrank`` codec: exact on matrices of its rank (up to its int8 factors), a projection otherwise,
and every malformed header refused before anything is allocated."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.pb import wire_pb2 as pb
from swarm.wire import lowrank, packets, quantize
from swarm.wire.codec_policy import WirePolicy, feeds_back
from swarm.wire.codecs import CodecError, decode, encode
from tests.conftest import read_metrics, run_ravn_local

FAST = settings(max_examples=30, deadline=None)


def rank_k(m: int, n: int, k: int, magnitude: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g)) * magnitude


@FAST
@given(
    m=st.integers(1, 300),
    n=st.integers(1, 300),
    k=st.integers(1, 40),
    rank=st.integers(1, 48),
    magnitude=st.sampled_from([1e-7, 1.0, 1e4]),  # gradients w.r.t. hidden states are ~1e-7
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([8, 64, 256]),
)
def test_a_matrix_of_at_most_the_codecs_rank_comes_back_up_to_the_int8_factors(
    m, n, k, rank, magnitude, seed, block_size
):
    x = rank_k(m, n, k, magnitude, seed)
    enc = encode(x, "lowrank", rank=rank, seed=seed, block_size=block_size)
    y = decode(enc)
    assert enc.rank == min(rank, m, n) and y.shape == x.shape and y.dtype == x.dtype
    assert len(enc.payload) == enc.rank * (m + n)  # one int8 code per factor entry
    err = float((y - x).norm() / x.norm())
    if k <= enc.rank:
        assert err < 0.03, err  # the subspace holds all of x: only the factors' rounding is lost
    else:
        assert err <= 1.03  # a projection never adds energy; the rounding adds a little


def test_a_tensor_is_the_matrix_of_rows_of_its_last_dimension() -> None:
    x = rank_k(512, 256, 5, 1.0, 0).view(4, 128, 256)
    enc = encode(x, "lowrank", rank=8)
    assert enc.rank == 8 and len(enc.payload) == 8 * (512 + 256)
    assert float((decode(enc) - x).norm() / x.norm()) < 0.02
    for shape, rank in (((), 1), ((7,), 1), ((0,), 0), ((3, 0), 0), ((2, 3, 5), 5)):
        enc = encode(torch.ones(shape), "lowrank")
        assert enc.rank == rank and torch.allclose(decode(enc), torch.ones(shape), rtol=0.01)


def test_what_a_low_rank_code_buys_on_a_tensor_that_has_the_structure() -> None:
    """Four times fewer bytes than int3_rot and a tenth of its error, on a rank-24 matrix plus 1% noise."""
    x = rank_k(512, 256, 24, 1.0, 3) + torch.randn(512, 256, generator=torch.Generator().manual_seed(4)) * 0.01 * 5
    low, three = packets.tensor_to_pb(x, "lowrank", rank=32), packets.tensor_to_pb(x, "int3_rot", zstd=True)
    err = {name: float((packets.tensor_from_pb(t) - x).norm() / x.norm()) for name, t in (("low", low), ("3", three))}
    assert low.ByteSize() * 1.4 < three.ByteSize() and err["low"] * 10 < err["3"], (
        low.ByteSize(),
        three.ByteSize(),
        err,
    )


def test_non_finite_input_is_refused() -> None:
    for bad in (float("nan"), float("inf")):
        x = torch.randn(8, 8)
        x[2, 3] = bad
        with pytest.raises(CodecError, match="NaN or Inf"):
            encode(x, "lowrank")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rank": 0}, "rank 0"),
        ({"rank": 65}, "rank 65"),  # above the smaller side of 64 x 100
        ({"rank": -1}, "rank -1"),
        ({"block_size": 0}, "block size"),
        ({"block_size": 3}, None),  # a valid int8 block size, so the scales no longer match
        ({"payload": b""}, "payload of"),
        ({"shape": (64, 99)}, "payload of"),  # one column fewer: the factors no longer fit
        ({"scales": b"\0" * 8}, "scales of"),
        ({"dtype": torch.int64}, "cannot decode"),
    ],
)
def test_malformed_messages_are_refused(change: dict, match: str | None) -> None:
    enc = encode(torch.randn(64, 100), "lowrank", rank=4)
    with pytest.raises(CodecError, match=match):
        decode(dataclasses.replace(enc, **change))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_bad_scales_are_refused(value: float) -> None:
    enc = encode(torch.randn(64, 100), "lowrank", rank=4)
    scales = torch.frombuffer(bytearray(enc.scales), dtype=torch.float32).clone()
    scales[1] = value
    with pytest.raises(CodecError, match="scale"):
        decode(dataclasses.replace(enc, scales=scales.numpy().tobytes()))


def test_the_wire_message_carries_the_rank_and_refuses_an_absurd_claim() -> None:
    x = rank_k(128, 64, 3, 1.0, 2)
    msg = pb.Tensor.FromString(packets.tensor_to_pb(x, "lowrank", rank=3).SerializeToString())
    assert msg.codec == pb.LOWRANK and msg.rank == 3
    assert float((packets.tensor_from_pb(msg) - x).norm() / x.norm()) < 0.02
    msg.rank = 1 << 30
    with pytest.raises(packets.WireError, match="rank"):
        packets.tensor_from_pb(msg)
    del msg.shape[:]
    msg.shape.extend([1 << 20, 1 << 20])  # a 4 TiB output from a 25 KB message
    msg.rank = 3
    with pytest.raises(packets.WireError, match="exceeds the limit"):
        packets.tensor_from_pb(msg)


def test_the_policy_sends_lowrank_both_ways_with_error_feedback_under_auto() -> None:
    policy = WirePolicy(forward="lowrank", backward="lowrank", error_feedback="auto", rank=4)
    assert feeds_back("auto", "lowrank") and not feeds_back("off", "lowrank")
    x = rank_k(2 * 16, 64, 4, 1.0, 5).view(2, 16, 64)
    act = policy.activations(pb.MicroBatch(id=3), x, None).activations.hidden
    assert (act.codec, act.rank) == (pb.LOWRANK, 4)
    assert float((policy.decode(act) - x).norm() / x.norm()) < 0.02
    g = torch.randn(2, 16, 64) * 1e-7  # full rank: what rank 4 drops is owed to the next gradient
    policy.gradients(pb.MicroBatch(id=3), g, to="up")
    residual = policy._feedback["up"].residual
    assert residual is not None and float(residual.norm()) > 0.5 * float(g.norm())


def test_the_sizes_are_arithmetic_on_the_header() -> None:
    assert quantize.matrix_shape((4, 128, 256)) == (512, 256)
    assert lowrank.sizes(32, (4, 128, 256), 64) == (32 * 512, 32 * 256, 256, 128)
    assert lowrank.effective_rank(32, (3, 5)) == 3


@pytest.mark.slow  # three peer processes train a few steps: over 20 s on a shared machine
def test_a_swarm_trains_with_lowrank_on_both_directions(tmp_path: Path) -> None:
    """``ravn local --wire-forward lowrank --wire-backward lowrank --wire-rank 8``: real peers, real wire."""
    run_ravn_local(
        tmp_path,
        "low",
        *("--peers", "3", "--model", "gpt-tiny", "--steps", "4", "--eval-every", "0", "--eval-batches", "1"),
        *("--wire-forward", "lowrank", "--wire-backward", "lowrank", "--wire-rank", "8"),
    )
    metrics = read_metrics(tmp_path / "low")
    summary = next(m for m in metrics if m["kind"] == "summary")
    assert summary["steps"] == 4 and summary["final_val_loss"] is not None
    sent = {s["stage"]: s["sent_codecs"] for s in summary["stages"]}
    assert set(sent[0]) == {"forward:lowrank"} and set(sent[2]) == {"backward:lowrank"}
    assert set(sent[1]) == {"forward:lowrank", "backward:lowrank"}
    logs = " ".join(p.read_text() for p in (tmp_path / "low" / "logs").glob("peer-*.log"))
    assert re.search(r"error feedback on", logs)  # 'auto' turns it on for lowrank gradients
