"""``ravn local`` on a checkpoint as a new user would run it: a wrong one is one line, never a traceback (#18).

Every case runs the real CLI as a subprocess. A checkpoint that cannot be trained fails in the preflight,
before any peer process exists (no peer log is ever written); a plan that cannot fit fails once the peers
announced their memory, with the memory needed and offered, and before any step. The bad-checkpoint runs
start together (each is a few seconds of imports) so that the file stays short.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from swarm.train.hf.checkpoint_check import INDEX_FILE  # noqa: E402
from swarm.train.hf.measure import HALF_PRECISION_SLOW, cpu_half_precision_slowdown  # noqa: E402
from swarm.train.hf.tiny import make_tiny_checkpoint  # noqa: E402
from tests.conftest import ROOT, ravn_cmd, read_metrics  # noqa: E402

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
PREFLIGHT_S = 90.0  # the preflight needs the imports of torch and transformers, on a loaded machine


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _no_config(ckpt: Path) -> str:
    (ckpt / "config.json").unlink()
    return str(ckpt / "config.json")


def _missing_shard(ckpt: Path) -> str:
    shards = sorted(set(json.loads((ckpt / INDEX_FILE).read_text())["weight_map"].values()))
    assert shards[-1].startswith("model-00002-of-"), shards
    (ckpt / shards[-1]).unlink()
    return str(ckpt / shards[-1])


def _wrong_shape(ckpt: Path) -> str:
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return "model.layers.1.mlp.up_proj.weight has shape [3, 64], but config.json implies [128, 64]"


def _unsupported(ckpt: Path) -> str:
    _edit_config(ckpt, model_type="t5", architectures=["T5ForConditionalGeneration"])
    return "'t5' is not supported; supported: llama, mistral, qwen2, gpt2"


def _bin_only(ckpt: Path) -> str:
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x02 not read")
    return "pytorch_model.bin"


BAD = {
    "no config.json": (_no_config, "llama", ()),
    "missing shard": (_missing_shard, "sharded", ()),
    "wrong shape": (_wrong_shape, "llama", ()),
    "unsupported architecture": (_unsupported, "llama", ()),
    ".bin only": (_bin_only, "llama", ()),
    "data that does not exist": (
        lambda ckpt: "--data /nonexistent/sums.jsonl: no such file or folder",
        "llama",
        ("--data", "/nonexistent/sums.jsonl"),
    ),
    "context beyond the positions": (
        lambda ckpt: f"context 512 exceeds the 128 positions of {ckpt / 'config.json'}",
        "llama",
        ("--context", "512"),
    ),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-ckpt")
    data = root / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "completion": f" {2 * i}"}) + "\n" for i in range(64)))
    return {
        "root": root,
        "data": data,
        "llama": make_tiny_checkpoint(root / "llama", "llama"),  # max_position_embeddings 128
        "sharded": make_tiny_checkpoint(root / "sharded", "llama", max_shard_size="500KB"),
    }


def _local(work: dict[str, Path], ckpt: Path, name: str, *extra: str) -> list[str]:
    return ravn_cmd(
        "local",
        "--runs-dir",
        str(work["root"] / "runs"),
        "--name",
        name,
        "--model",
        str(ckpt),
        "--finetune",
        "lora",
        "--data",
        str(work["data"]),
        *extra,
    )


@pytest.fixture(scope="module")
def bad_runs(work) -> dict[str, tuple[subprocess.CompletedProcess, str, float, Path]]:
    """Every bad case at once: (the finished process, what its error must name, seconds it took, its run dir)."""
    started = {}
    for i, (case, (spoil, base, extra)) in enumerate(BAD.items()):
        ckpt = Path(shutil.copytree(work[base], work["root"] / f"case{i}"))
        names = spoil(ckpt)
        cmd = _local(work, ckpt, f"case{i}", "--peers", "2", *extra)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started[case] = (proc, cmd, names, time.monotonic(), work["root"] / "runs" / f"case{i}")
    out = {}
    try:
        for case, (proc, cmd, names, t0, run_dir) in started.items():
            stdout, stderr = proc.communicate(timeout=PREFLIGHT_S)
            out[case] = (
                subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr),
                names,
                time.monotonic() - t0,
                run_dir,
            )
    finally:
        for proc, *_ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_one_line_before_any_peer(bad_runs, case):
    proc, names, seconds, run_dir = bad_runs[case]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert names in lines[0], (names, lines[0])
    assert not (run_dir / "logs").exists(), "no peer may start for a checkpoint the preflight refuses"
    assert proc.stdout == "", "nothing started, so nothing to report"
    assert seconds < PREFLIGHT_S


def test_default_context_follows_the_checkpoint(work):
    """max_position_embeddings 128: without --context the run trains at 128 tokens (it died at 512 before #18)."""
    proc = subprocess.run(
        _local(
            work,
            work["llama"],
            "default-context",
            "--peers",
            "1",
            "--steps",
            "2",
            "--micro-batches",
            "2",
            "--micro-batch-size",
            "2",
            "--eval-every",
            "0",
            "--eval-batches",
            "1",
        ),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    run = work["root"] / "runs" / "default-context"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert json.loads((run / "config.json").read_text())["model"]["context"] == 128
    assert [m["step"] for m in read_metrics(run) if m["kind"] == "step"] == [0, 1], proc.stdout
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    # the default --dtype is bf16: on a CPU that emulates it, the run says so in one line (and on one
    # that computes it natively, it says nothing); near the threshold either is right
    slowdown, note = cpu_half_precision_slowdown("bf16"), "note: this CPU computes bf16" in proc.stdout
    if slowdown >= 2 * HALF_PRECISION_SLOW:
        assert note, (slowdown, proc.stdout)
    elif slowdown <= HALF_PRECISION_SLOW / 2:
        assert not note, (slowdown, proc.stdout)


@pytest.mark.slow  # a real run; the default suite keeps newcomers under 10 minutes
def test_plan_that_cannot_fit_names_the_memory(work):
    """Peers offering 1 MiB each: the run ends with the memory needed and offered, before any step."""
    t0 = time.monotonic()
    proc = subprocess.run(
        _local(work, work["llama"], "no-fit", "--peers", "1", "--steps", "2", "--peer-memory", "1MiB"),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    failed = [line for line in output.splitlines() if "run failed" in line]
    assert len(failed) == 1, output
    assert "no plan fits the peers' memory" in failed[0] and "MiB per layer" in failed[0], failed[0]
    assert "the peers offer peer-0 1 MiB;" in failed[0], failed[0]
    assert "step 1/" not in output
    assert not (work["root"] / "runs" / "no-fit" / "adapter").exists()
    assert time.monotonic() - t0 < 120, "the peers that never trained are stopped at once"
