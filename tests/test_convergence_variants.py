"""benchmarks.convergence runs a pair once per error-feedback setting exactly when its gradient codec is lossy."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import convergence  # noqa: E402
from swarm.wire.codecs import LOSSY_CODECS  # noqa: E402


def test_its_lossy_codecs_are_the_wires() -> None:
    """The benchmark keeps its own list (it imports no torch); lowrank gradients once ran without a feedback label."""
    assert convergence.LOSSY == set(LOSSY_CODECS)


def test_a_lossy_gradient_codec_gets_one_run_per_feedback_setting() -> None:
    runs = convergence.variants(["fp32/fp32", "int3_rot/ecsq", "int3_rot/lowrank"], ["auto", "off"], ["sync"])
    assert [v.label for v in runs] == [
        "fp32/fp32",
        "int3_rot/ecsq ef=auto",
        "int3_rot/ecsq ef=off",
        "int3_rot/lowrank ef=auto",
        "int3_rot/lowrank ef=off",
    ]
