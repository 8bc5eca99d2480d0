"""Error feedback on the gradients a stage sends upstream: one residual per destination, and a switch.

A stage with replicated upstream holders sends each holder the gradients of that holder's own
micro-batches. The residual error feedback keeps is what one holder is still owed; handing it to
another holder corrupts both streams (the running sums stop telescoping).
"""

import re
from pathlib import Path

import pytest
import torch

from swarm.config import TrainConfig
from swarm.messages import train_from_pb, train_to_pb
from swarm.pb import wire_pb2 as pb
from swarm.wire import quantize
from swarm.wire.codec_policy import WirePolicy, feeds_back
from swarm.wire.codecs import decode, encode
from swarm.wire.packets import tensor_from_pb, tensor_to_pb
from tests.conftest import read_metrics, run_ravn_local


def biased_stream(seed: int, steps: int, n: int = 4096) -> list[torch.Tensor]:
    """Gradients with a persistent small bias and a few large entries: int8 drops the bias every time."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(n, generator=g) * 1e-3
    out = []
    for _ in range(steps):
        x = bias + torch.randn(n, generator=g) * 1e-3
        x[torch.randint(0, n, (40,), generator=g)] += torch.randn(40, generator=g) * 0.1
        out.append(x)
    return out


def sent(policy: WirePolicy, mb_id: int, grad: torch.Tensor, to: str) -> torch.Tensor:
    packet = policy.gradients(pb.MicroBatch(id=mb_id), grad, to=to)
    return tensor_from_pb(packet.gradients.grad)


def test_residual_owed_to_one_upstream_holder_is_not_sent_to_another():
    policy = WirePolicy(forward="fp32", backward="int8", error_feedback="on")
    streams = {"holder-a": biased_stream(1, 60), "holder-b": biased_stream(2, 60)}
    true_sum = {p: torch.zeros(4096) for p in streams}
    sent_sum = {p: torch.zeros(4096) for p in streams}
    worst_step = 0.0
    for i in range(60):
        for peer, xs in streams.items():  # micro-batches alternate between the two holders
            x = xs[i]
            true_sum[peer] += x
            sent_sum[peer] += sent(policy, i, x, peer)
            worst_step = max(worst_step, float((x - decode(encode(x, "int8", seed=i))).norm()))
    for peer in streams:
        # Each holder's running sum is off by its own last residual only: at most about one step's error.
        drift = float((true_sum[peer] - sent_sum[peer]).norm())
        assert drift <= 2 * worst_step, (peer, drift, worst_step)
    # The first gradient a holder receives carries nothing from the other holder's stream.
    fresh = WirePolicy(forward="fp32", backward="int8", error_feedback="on")
    sent(fresh, 0, streams["holder-a"][0], "holder-a")
    torch.testing.assert_close(
        sent(fresh, 1, streams["holder-b"][0], "holder-b"),
        decode(encode(streams["holder-b"][0], "int8", seed=1)),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("codec", ["int8", "int4", "int4_rot"])
def test_error_feedback_off_sends_plain_quantisation(codec):
    xs = biased_stream(3, 5)
    off = WirePolicy(forward="fp32", backward=codec, error_feedback="off")
    on = WirePolicy(forward="fp32", backward=codec, error_feedback="on")
    differs = False
    for i, x in enumerate(xs):
        mb = pb.MicroBatch(id=i)
        plain = tensor_to_pb(x, codec, block_size=off.block_size, seed=i)
        assert off.gradients(mb, x, to="up").gradients.grad == plain
        differs |= on.gradients(mb, x, to="up").gradients.grad != plain
    assert differs, "with error feedback on, later gradients must carry a residual"


def test_error_feedback_is_off_by_default_and_survives_the_assignment_message():
    assert TrainConfig().error_feedback_backward == "off"  # the library's default; the CLI's is "auto"
    for mode in ("off", "on", "auto"):
        assert train_from_pb(train_to_pb(TrainConfig(error_feedback_backward=mode))).error_feedback_backward == mode


def test_auto_error_feedback_is_decided_per_link_by_the_links_codec() -> None:
    """A per-link ``--wire-backward auto`` that picks int3_rot for one link gets error feedback there only.

    Before, ``auto`` was resolved once per run from ``--wire-backward``, which is ``auto`` itself in that
    case, so no link carried a residual even where it sent int3_rot (the codec it pays for).
    """
    policy = WirePolicy(
        forward="fp32", backward="int8", error_feedback="auto", backward_to={"a": "int3_rot", "b": "int8"}
    )
    grad = torch.randn(4, 256)
    for i in range(3):
        policy.gradients(pb.MicroBatch(id=i), grad, to="a")
        policy.gradients(pb.MicroBatch(id=i), grad, to="b")
    assert set(policy._feedback) == {"a"}
    assert policy.feedback_text() == "on to a, off to b"
    assert [feeds_back(m, c) for m in ("on", "off", "auto") for c in ("fp32", "int8", "int3_rot")] == [
        False, True, True, False, False, False, False, False, True
    ]  # fmt: skip


@pytest.mark.slow  # a whole swarm for over 20 s: keeps the default suite under 10 minutes
def test_error_feedback_flag_reaches_every_peer(tmp_path: Path) -> None:
    """``ravn local --error-feedback-backward on`` (not the default): each peer process runs with it."""
    run_ravn_local(
        tmp_path,
        "ef-on",
        "--peers",
        "3",
        "--model",
        "gpt-tiny",
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--wire-backward",
        "int8",
        "--error-feedback-backward",
        "on",
    )
    logs = sorted((tmp_path / "ef-on" / "logs").glob("peer-*.log"))
    assigned = [re.search(r"assigned stage .*\(error feedback (\w+)\)", p.read_text()) for p in logs]
    assert len(logs) == 3 and all(assigned), [p.read_text()[-1000:] for p in logs]
    assert {m.group(1) for m in assigned} == {"on"}
    summary = next(m for m in read_metrics(tmp_path / "ef-on") if m["kind"] == "summary")
    assert summary["steps"] == 3 and summary["error_feedback_backward"] == "on"


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The scale dtype of every quantisation pass the codecs run, in order."""
    calls: list[torch.dtype] = []
    real = quantize.quantize

    def counted(*args, **kwargs):
        calls.append(args[4] if len(args) > 4 else kwargs.get("scale_dtype", torch.float16))
        return real(*args, **kwargs)

    monkeypatch.setattr(quantize, "quantize", counted)
    return calls


@pytest.mark.parametrize("error_feedback", ["off", "on"])
@pytest.mark.parametrize("codec", ["int8", "int4_rot"])
def test_a_small_gradient_is_quantised_once(passes: list[torch.dtype], codec: str, error_feedback: str) -> None:
    """Gradients w.r.t. hidden states (~1e-7) need fp32 scales; finding that out with an fp16 pass first
    quantised every gradient twice on the hot path."""
    policy = WirePolicy("fp32", codec, error_feedback=error_feedback)
    grad = torch.randn(2, 16, 64) * 1e-7
    packet = policy.gradients(pb.MicroBatch(id=3), grad, to="up")
    assert passes == [torch.float32]
    y = tensor_from_pb(packet.gradients.grad)
    assert float((y - grad).norm() / grad.norm()) < 0.2


@pytest.mark.parametrize("error_feedback", ["off", "on"])
def test_coded_scales_do_not_hide_that_a_links_gradients_are_small(passes: list[torch.dtype], error_feedback: str):
    """With zstd the scales travel coded, shorter than 4 bytes per block: the link must still remember
    that its last gradient had fp32 scales, or every later gradient is quantised twice."""
    policy = WirePolicy("fp32", "int3_rot", zstd=True, error_feedback=error_feedback)
    grad = torch.randn(4, 128, 256) * 1e-7
    for i in range(3):
        passes.clear()
        packet = policy.gradients(pb.MicroBatch(id=i), grad, to="up")
        assert packet.gradients.grad.scales_compression == pb.ZSTD_PLANES
        assert passes == [torch.float32], i


def test_a_link_whose_gradients_are_not_small_stops_trying_fp32_scales_first(passes: list[torch.dtype]) -> None:
    """A wrong guess costs the second pass once, not on every gradient: the link remembers the last one."""
    policy = WirePolicy("fp32", "int8")
    large, small = torch.randn(2, 16, 64), torch.randn(2, 16, 64) * 1e-7
    for grad, expected in [
        (large, [torch.float32, torch.float16]),  # guessed small: fp32 first, then what the rule chose
        (large, [torch.float16]),
        (small, [torch.float16, torch.float32]),
        (small, [torch.float32]),
    ]:
        passes.clear()
        packet = policy.gradients(pb.MicroBatch(id=3), grad, to="up")
        assert passes == expected
        assert packet.gradients.grad.scales == tensor_to_pb(grad, "int8", block_size=64, seed=3).scales
    policy.gradients(pb.MicroBatch(id=4), small, to="other")  # each link guesses on its own
    assert policy._small == {"up": True, "other": True}
