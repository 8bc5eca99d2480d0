"""Steps and time to a target loss (``benchmarks/time_to_target.py``): the arithmetic, on made-up runs.

The lab half of that benchmark is covered in ``tests/lab/test_benchmarks_smoke.py``; here only the
parts that turn validation curves and step times into the table, where an off-by-one would pass
unnoticed in a long run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # benchmarks/ is not an installed package

from benchmarks import time_to_target as ttt  # noqa: E402
from benchmarks.pipeline_common import RunRecord, Workload  # noqa: E402


def test_crossing_interpolates_between_evaluations():
    evals = [(9, 3.0), (19, 2.5), (29, 2.0)]  # after 10, 20 and 30 steps
    assert ttt.crossing_step(evals, 3.0) == 10.0
    assert ttt.crossing_step(evals, 2.25) == pytest.approx(25.0)
    assert ttt.crossing_step(evals, 2.0) == pytest.approx(30.0)
    assert ttt.crossing_step(evals, 1.9) is None
    assert ttt.crossing_step([(9, 2.0), (19, 2.0)], 2.0) == 10.0


def _result(pair: str, seed: int, evals: list[tuple[int, float]], steps: int = 50) -> dict:
    return {"pair": pair, "seed": seed, "staleness_bound": -1, "feedback": "", "steps": steps, "evals": evals}


def test_the_target_is_each_seeds_fp32_loss_at_eighty_percent():
    curve = [(i * 10 + 9, 3.0 - 0.1 * i) for i in range(5)]  # 10..50 steps, 3.0 down to 2.6
    results = [
        _result("fp32/fp32", 0, curve),
        _result("fp32/fp32", 1, [(s, loss - 0.05) for s, loss in curve]),
        _result("int8/int8", 0, [(s, loss + 0.05) for s, loss in curve]),  # half an eval interval later
        _result("int8/int8", 1, [(s, loss + 0.5) for s, loss in curve]),  # never gets there
        {**_result("int8/int8", 0, curve), "staleness_bound": 1},  # async runs are not sync curves
    ]
    out = ttt.steps_to_target(results)
    assert out["fp32/fp32"]["per_seed"][0] == {"target": pytest.approx(2.7), "steps": pytest.approx(40.0)}
    assert out["fp32/fp32"]["per_seed"][1]["target"] == pytest.approx(2.65)
    assert out["int8/int8"]["per_seed"][0]["steps"] == pytest.approx(45.0)
    assert out["int8/int8"]["per_seed"][1]["steps"] is None
    assert out["int8/int8"]["feedback"] == ""  # the lab check reads the run of that error feedback
    auto = [_result("fp32/fp32", 0, curve), {**_result("int3_rot/int3_rot", 0, curve), "feedback": "auto"}]
    assert ttt.steps_to_target(auto)["int3_rot/int3_rot"]["feedback"] == "auto"  # the run of that setting
    with pytest.raises(SystemExit, match="eval-every"):
        ttt.steps_to_target([_result("fp32/fp32", 0, [(24, 3.0), (49, 2.0)])])


def _record(mode: str, system: str, step_s: float, up_bytes_per_step: int, steps: int = 10) -> RunRecord:
    tokens_per_step = Workload(micro_batches=4).tokens_per_step
    return RunRecord(
        system=system,
        mode=mode,
        cap="10mbit",
        tokens=steps * tokens_per_step,
        train_s=steps * step_s,
        final_val_loss=2.0,
        evals=[],
        host_bytes={f"p{i}": {"up": steps * up_bytes_per_step, "down": 0} for i in range(3)},
        step_ends=[(i + 1) * step_s for i in range(steps)],
    )


def test_time_to_target_is_steps_times_step_time_and_says_what_bounds_it():
    per_seed = {0: {"target": 2.7, "steps": 240.0}, 1: {"target": 2.6, "steps": 240.0}}
    later = {0: {"target": 2.7, "steps": 260.0}, 1: {"target": 2.6, "steps": 280.0}}
    targets = {
        "fp32/fp32": {"per_seed": per_seed, "run_steps": 300},
        "bf16/bf16": {"per_seed": later, "run_steps": 300},
        "int8/int8": {"per_seed": later, "run_steps": 300},
    }
    # 10 Mbit/s moves 1.25 MB/s: 5 MB per step is 4 s on the link, 1.25 MB 1 s
    records = [
        _record("GPipe fp32", "torch", 4.0, 5_000_000),
        _record("GPipe bf16", "torch", 2.0, 2_500_000),
        _record("sync int8/int8", "ravn", 1.5, 1_250_000),
    ]
    meta = {"workload": Workload(micro_batches=4).__dict__, "skip": 2, "caps": ["10mbit"], "load_start": [0],
            "load_end": [0]}  # fmt: skip
    rows = {r.label: r for r in ttt.cap_rows(records, targets, "10mbit", Workload(micro_batches=4), 2)}
    assert rows["torch GPipe fp32"].step_s == pytest.approx(4.0)
    assert rows["torch GPipe fp32"].link_step_s == pytest.approx(4.0)
    assert rows["torch GPipe fp32"].bound == "link"
    assert rows["Ravn int8/int8 (default on 2026-12-01)"].bound == "compute"  # 1.5 s measured against 1 s on the link
    text = ttt.report(records, targets, meta, runs_dir=None)
    row = next(line for line in text.splitlines() if line.startswith("| Ravn int8/int8"))
    # 270 steps x 1.5 s = 6.75 min; GPipe fp32 240 x 4 s = 16 min -> 2.37x; bf16 270 x 2 s -> 1.33x
    # link-bound: 270 x 1 s = 4.5 min -> 3.56x and 2.00x
    assert "| 270 (260..280) | 6.8 min | 2.37x | 1.33x | 4.5 min | 3.56x | 2.00x |" in row


def test_a_seed_that_never_reaches_the_target_makes_the_time_a_lower_bound():
    per_seed = {0: {"target": 2.7, "steps": 240.0}, 1: {"target": 2.6, "steps": 240.0}}
    missed = {0: {"target": 2.7, "steps": 280.0}, 1: {"target": 2.6, "steps": None}}
    targets = {
        "fp32/fp32": {"per_seed": per_seed, "run_steps": 300},
        "int8/int8": {"per_seed": missed, "run_steps": 300},
    }
    records = [_record("GPipe fp32", "torch", 4.0, 5_000_000), _record("sync int8/int8", "ravn", 2.0, 1_250_000)]
    meta = {"workload": Workload(micro_batches=4).__dict__, "skip": 2, "caps": ["10mbit"], "load_start": [0],
            "load_end": [0]}  # fmt: skip
    row = next(x for x in ttt.report(records, targets, meta, None).splitlines() if x.startswith("| Ravn int8/int8"))
    # the missing seed counts as 300 steps: >= 290 x 2 s = 9.7 min, so at most 960 / 580 = 1.66x
    assert "≥ 290: 1 of 2 seeds not in 300 steps | ≥ 9.7 min | ≤ 1.66x |" in row
