"""The pipeline benchmarks end to end on tiny settings (`pytest -m lab tests/lab`, root, ~1 min).

One Ravn sync fp32 run and one torch GPipe run of gpt-tiny in the lab. They apply the same math to
the same data, so their losses must agree: that is what makes the speed comparison fair. Also
checks that the kernel byte counters saw the traffic, and that the table and targets render. The
same holds for bf16 on the wire (torch casting at the stage boundary, Ravn's bf16 codec), which is
what lets ``benchmarks/time_to_target.py`` take GPipe bf16's loss curve from Ravn's bf16 runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # benchmarks/ is not an installed package


@pytest.fixture(scope="module")
def lab_ok():
    from benchmarks.lab import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"swarm lab unavailable: {reason}")


@pytest.mark.lab
def test_ravn_and_torch_pipelines_agree_and_are_counted(lab_ok, tmp_path):
    from benchmarks import pipeline, vs_torch_pipelining
    from benchmarks.lab import Lab, list_netns
    from benchmarks.pipeline_common import Workload, cap_links, link_bound_tokens_per_s, run_ravn

    workload = Workload(model="gpt-tiny", steps=6, micro_batches=4, micro_batch_size=2, eval_every=3)
    with Lab(cap_links("50mbit"), coordinator=True) as lab:
        ravn = run_ravn(lab, "50mbit", "sync fp32", workload, tmp_path / "ravn")
        lab_id = lab.id
    with Lab(cap_links("50mbit"), coordinator=True) as lab:
        torch_run = vs_torch_pipelining.run_torch(lab, "50mbit", "GPipe fp32", workload, tmp_path, timeout_s=90)
    assert [n for n in list_netns() if lab_id in n] == []

    tokens = workload.steps * workload.tokens_per_step
    assert ravn.tokens == torch_run.tokens == tokens
    assert len(ravn.evals) == len(torch_run.evals) == workload.steps // workload.eval_every
    for (_, t_ravn, l_ravn), (_, t_torch, l_torch) in zip(ravn.evals, torch_run.evals, strict=True):
        assert t_ravn == t_torch
        assert l_ravn == pytest.approx(l_torch, rel=1e-4)  # same weights, data and recipe
    # fp32 hidden states (64 floats/token) cross two links each way, plus headers and one eval pass;
    # the counters are sampled every 0.1 s, so a one-second window is only roughly right
    for run in (ravn, torch_run):
        assert run.train_s > 0 and run.tokens_per_s > 0
        assert 0.7 * 2 * 2 * 64 * 4 <= run.wire_bytes_per_token < 3 * 2 * 2 * 64 * 4, run.host_bytes
        assert link_bound_tokens_per_s(run, cap_links("50mbit")) < float("inf")
    assert ravn.payload_bytes_per_token and ravn.stages and len(ravn.stages) == 3

    assert "sync fp32" in pipeline.table([ravn])
    text = vs_torch_pipelining.table([torch_run, ravn], compute_bound=1e6)
    assert "1.00x" in text and "Ravn sync fp32" in text
    assert any(ok is not None for _, ok, _ in vs_torch_pipelining.targets([torch_run, ravn], 1e6))


@pytest.mark.lab
def test_torch_bf16_boundary_computes_ravn_bf16_wire(lab_ok, tmp_path):
    from benchmarks import time_to_target, vs_torch_pipelining
    from benchmarks.lab import Lab
    from benchmarks.pipeline_common import Workload, cap_links, run_ravn

    workload = Workload(model="gpt-tiny", steps=6, micro_batches=4, micro_batch_size=2, eval_every=6)
    with Lab(cap_links("50mbit"), coordinator=True) as lab:
        ravn = run_ravn(lab, "50mbit", "sync bf16/bf16", workload, tmp_path / "ravn")
    with Lab(cap_links("50mbit"), coordinator=True) as lab:
        torch_run = vs_torch_pipelining.run_torch(lab, "50mbit", "GPipe bf16", workload, tmp_path, timeout_s=90)
    assert len(ravn.step_losses) == len(torch_run.step_losses) == workload.steps
    assert ravn.step_losses == pytest.approx(torch_run.step_losses, rel=1e-4)
    assert ravn.evals[-1][2] == pytest.approx(torch_run.evals[-1][2], rel=1e-4)
    # bf16 hidden states: 2 bytes x 64 per token across two links each way, plus headers
    assert 0.7 * 2 * 2 * 64 * 2 <= torch_run.wire_bytes_per_token < 3 * 2 * 2 * 64 * 2, torch_run.host_bytes
    assert len(torch_run.step_ends) == workload.steps and time_to_target.seconds_per_step(torch_run, 1) > 0


@pytest.mark.lab
def test_wire_bytes_by_part_of_the_run_are_counted_per_window(lab_ok, tmp_path):
    """benchmarks/wire_thirds.py: each window of steps gets its own kernel bytes, and they add up."""
    from benchmarks import wire_thirds
    from benchmarks.pipeline_common import Workload

    workload = Workload(model="gpt-tiny", steps=6, micro_batches=4, micro_batch_size=2, eval_every=7)
    # 10 Mbit/s links: the tiny model's steps last long enough for the counters' 0.1 s samples
    base = wire_thirds.measure("sync fp32", workload, "10mbit", tmp_path, every=2)
    run = wire_thirds.measure("sync int3_rot/int3_rot zstd", workload, "10mbit", tmp_path, every=2)
    for r, bytes_per_value in ((base, 4), (run, 0.5)):
        assert [(w["first_step"], w["last_step"]) for w in r["windows"]] == [(0, 1), (2, 3), (4, 5)]
        assert all(w["tokens"] == 2 * workload.tokens_per_step for w in r["windows"])
        # hidden states of 64 values per token cross two links each way, plus headers and ACKs; a window
        # of steps must not take its neighbours' bytes (reports arrive in batches: step_ends)
        per_token = [w["kernel_bytes"] / w["tokens"] for w in r["windows"]]
        plain = 4 * 64 * bytes_per_value
        assert all(0.3 * plain < b < 3 * plain + 200 for b in per_token), per_token
    assert len(run["losses"]) == 6
    text = wire_thirds.report(base, run, parts=3)
    assert "| 0–2 |" in text and "| 4–6 |" in text and "fewer than fp32" in text
    wire_thirds.plot(base, run, tmp_path / "thirds.png")
    assert (tmp_path / "thirds.png").stat().st_size > 0


def test_step_ends_come_from_the_measured_durations_not_the_bunched_report_arrivals():
    from benchmarks.wire_thirds import step_ends

    # a report arrives at or after its step's end (the first came at once; the other two together)
    steps = [{"time": 11.0, "seconds": 1.0}, {"time": 12.5, "seconds": 1.0}, {"time": 12.5, "seconds": 0.5}]
    assert step_ends(steps) == [11.0, 12.0, 12.5]


@pytest.mark.lab
def test_lora_fine_tuning_of_a_checkpoint_runs_in_the_lab(lab_ok, tmp_path):
    """``benchmarks/pipeline.py --model DIR``: a checkpoint's LoRA fine-tuning, sync and async, on capped links."""
    from benchmarks.lab import Lab
    from benchmarks.pipeline_common import Workload, cap_links, run_ravn
    from swarm.train.hf.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "gpt2", n_layers=3)
    data = tmp_path / "data.txt"
    data.write_text("the swarm trains together over home links. " * 400)
    workload = Workload(
        model=str(ckpt), data=str(data), dtype="fp32", train_samples=32,
        steps=4, micro_batches=4, micro_batch_size=2, eval_every=4,
    )  # fmt: skip
    for mode in ("sync int4_rot/ecsq zstd", "async int4_rot/ecsq zstd"):
        with Lab(cap_links("50mbit"), coordinator=True) as lab:
            run = run_ravn(lab, "50mbit", mode, workload, tmp_path / mode.replace(" ", "-").replace("/", "-"))
        assert run.tokens == workload.steps * workload.tokens_per_step == 4 * 4 * 2 * 128
        assert len(run.stages) == 3 and run.payload_bytes_per_token and run.wire_bytes_per_token > 0
        sent = {codec for s in run.stages for codec in s.get("sent_codecs", {})}
        assert {"forward:int4_rot", "backward:ecsq"} <= sent, sent
