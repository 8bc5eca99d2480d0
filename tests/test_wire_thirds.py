"""benchmarks/wire_thirds.py puts each step's end where it happened, however late its report arrived.

Reports travel in batches, and the last one can wait for the final validation pass: CI's lab smoke test
once counted 88, 32 and 2 bytes per token over three windows of one int3_rot run whose bytes were even,
because the ends had been anchored at that last, late report and every window slid by the validation's
length. The peer's step durations tile the run, so the ends are fixed up to one offset, and the report
that arrived soonest after its step bounds it best.
"""

from __future__ import annotations

import pytest

from benchmarks.wire_thirds import step_ends


def test_a_late_last_report_does_not_shift_the_steps_ends() -> None:
    start, durations = 10.0, [1.0, 1.5, 1.0, 2.0, 1.0, 1.0]
    true_ends, t = [], start
    for d in durations:
        t += d
        true_ends.append(t)
    arrivals = [e + 0.05 for e in true_ends[:4]] + [true_ends[-1] + 4.0] * 2  # the last two wait for a 4 s eval
    steps = [{"seconds": d, "time": a} for d, a in zip(durations, arrivals, strict=True)]
    assert step_ends(steps) == pytest.approx([e + 0.05 for e in true_ends])


def test_prompt_reports_give_the_ends_themselves() -> None:
    steps = [{"seconds": 2.0, "time": 3.0}, {"seconds": 2.0, "time": 5.0}, {"seconds": 2.0, "time": 7.0}]
    assert step_ends(steps) == pytest.approx([3.0, 5.0, 7.0])
