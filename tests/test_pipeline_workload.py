"""The lab benchmarks' workload: a built-in preset, or LoRA fine-tuning of a Hugging Face checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # benchmarks/ is not an installed package

from benchmarks.pipeline_common import RAVN_MODES, RunRecord, Workload  # noqa: E402


def test_a_preset_workload_passes_no_data_flags():
    args = Workload(micro_batches=4).ravn_args(RAVN_MODES["sync fp32"])
    assert "--data" not in args and "--dtype" not in args and "--train-samples" not in args
    assert Workload().tokens_per_step == 8 * 4 * 128


def test_a_checkpoint_workload_trains_at_its_context_on_the_given_data(tmp_path):
    from swarm.train.hf.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "gpt2")  # 128 positions: under the default 512
    w = Workload(model=str(ckpt), data="docs", dtype="fp32", train_samples=64, micro_batches=4, micro_batch_size=2)
    assert w.context == 128 and w.tokens_per_step == 4 * 2 * 128
    args = w.ravn_args(RAVN_MODES["async int4_rot/ecsq zstd"])
    flags = dict(zip(args[::2], args[1::2], strict=False))
    assert flags["--model"] == str(ckpt) and flags["--data"] == "docs" and flags["--dtype"] == "fp32"
    assert flags["--train-samples"] == "64"
    assert ("--wire-forward", "int4_rot") in zip(args, args[1:], strict=False)
    assert ("--schedule", "async") in zip(args, args[1:], strict=False)


def _run(cap: str, mode: str, tokens_per_s: float) -> RunRecord:
    return RunRecord("ravn", mode, cap, int(tokens_per_s * 10), 10.0, 2.0, [], {})


def test_the_report_judges_each_async_mode_against_sync_at_its_own_wires_and_lists_no_target_it_did_not_run():
    """#20's speed targets (1.15x at 10 and 50 Mbit/s, no slower uncapped) against the sync mode of the same wires;
    a target whose runs are not in the invocation is left out, not printed as "n/a"."""
    from benchmarks.pipeline import sync_of, targets

    assert sync_of("async int4_rot/ecsq zstd in-flight 4") == "sync int4_rot/ecsq zstd"
    assert sync_of("sync fp32") is None
    runs = [
        _run("50mbit", "sync int4_rot/ecsq zstd", 5000),
        _run("50mbit", "async int4_rot/ecsq zstd in-flight 4", 5300),
        _run("10mbit", "sync int4_rot/ecsq zstd", 3500),
        _run("10mbit", "async int4_rot/ecsq zstd", 4800),
        _run("lan", "sync int4_rot/ecsq zstd", 5000),
        _run("lan", "async int4_rot/ecsq zstd in-flight 4", 5100),
        _run("lan", "async int3_rot/int3_rot zstd", 9000),  # its sync was not run: no target
    ]
    got = {t: (ok, ev) for t, ok, ev in targets(runs)}
    assert got == {
        "50mbit: async int4_rot/ecsq zstd in-flight 4 >= 1.15x sync int4_rot/ecsq zstd": (False, "1.06x"),
        "10mbit: async int4_rot/ecsq zstd >= 1.15x sync int4_rot/ecsq zstd": (True, "1.37x"),
        "lan: async int4_rot/ecsq zstd in-flight 4 >= 1x sync int4_rot/ecsq zstd": (True, "1.02x"),
    }


def test_runs_on_cpu_shares_say_how_often_each_peer_was_held_back_and_saved_runs_still_load():
    from benchmarks.pipeline import table

    shared = _run("50mbit", "sync fp32", 5000)
    assert "CPU throttled" not in table([shared])
    own = RunRecord.from_dict(
        {**shared.to_dict(), "cpu_per_peer": 0.6, "cpu_throttled": {"p1": 0.5, "p0": 0.25, "p2": 0.125}}
    )
    text = table([own])
    assert "CPU throttled per peer" in text.splitlines()[0]
    assert text.splitlines()[2].endswith("| 25% / 50% / 12% |")
    before = {k: v for k, v in shared.to_dict().items() if not k.startswith("cpu_")}  # a record saved before shares
    assert RunRecord.from_dict(before).cpu_per_peer is None
