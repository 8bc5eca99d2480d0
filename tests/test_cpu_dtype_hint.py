"""A CPU that emulates bf16/fp16 is named, with what to do about it.

On an AVX2-only EPYC a 0.5 B Llama's bf16 block took minutes per micro-batch: a (512 x 1536) @ (1536 x 4224)
product ran 17x slower in bf16 than in fp32. The real-process check is
tests/test_bad_checkpoint_cli.py::test_default_context_follows_the_checkpoint (bf16 is the default).
"""

from __future__ import annotations

import math

import pytest

from swarm.train.hf import measure


def test_fp32_is_never_slow() -> None:
    assert measure.cpu_half_precision_slowdown("fp32") == 1.0
    assert measure.cpu_dtype_hint("fp32") == ""


def test_the_slowdown_is_measured_on_this_cpu() -> None:
    slowdown = measure.cpu_half_precision_slowdown("bf16")
    assert math.isfinite(slowdown) and slowdown > 0


@pytest.mark.parametrize("slowdown, said", [(17.0, True), (measure.HALF_PRECISION_SLOW, True), (1.3, False)])
def test_the_hint_names_the_slowdown_and_the_way_out(monkeypatch: pytest.MonkeyPatch, slowdown, said) -> None:
    monkeypatch.setattr(measure, "cpu_half_precision_slowdown", lambda dtype: slowdown)
    hint = measure.cpu_dtype_hint("bf16")
    if said:
        assert hint.startswith(f"this CPU computes bf16 {slowdown:.0f}x slower than fp32")
        assert "--dtype fp32" in hint and "--quant int8 or nf4" in hint
    else:
        assert hint == ""
