"""``ravn local`` as a user runs it: the loss falls, artefacts appear, the checkpoint reloads, Ctrl-C is clean."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import torch

from swarm.checkpoint import load_checkpoint
from swarm.data import Corpus
from tests.conftest import ROOT, processes_with, ravn_cmd, read_metrics, run_ravn_local


def validation_loss(model: torch.nn.Module, batches: int, batch_size: int, context: int) -> float:
    corpus = Corpus.load("stdlib")
    total = tokens = 0.0
    with torch.no_grad():
        for i in range(batches):
            x, y = corpus.batch(split="val", seed=0, step=0, index=i, batch_size=batch_size, context=context)
            total += float(model.loss_sum(model(x), y))
            tokens += y.numel()
    return total / tokens


def test_local_swarm_trains_and_checkpoint_reloads(tmp_path: Path) -> None:
    proc = run_ravn_local(
        tmp_path, "short", "--peers", "3", "--steps", "60", "--eval-every", "30", "--eval-batches", "4"
    )
    run_dir = tmp_path / "short"
    assert "checkpoint:" in proc.stdout and "loss curve:" in proc.stdout
    assert re.search(r"step \d+/60 \| loss [\d.]+ .*tok/s \| wire [\d.]+ MB/s", proc.stdout), proc.stdout
    metrics = read_metrics(run_dir)
    losses = [m["loss"] for m in metrics if m["kind"] == "step"]
    evals = [m["loss"] for m in metrics if m["kind"] == "eval"]
    assert len(losses) == 60 and len(evals) == 2
    assert losses[0] > 5.0, "a fresh byte-level model starts near ln(256) = 5.55"
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, f"loss did not fall: {losses[0]:.3f} -> {losses[-5:]}"
    assert (run_dir / "loss.png").stat().st_size > 1000

    model, cfg = load_checkpoint(run_dir / "model.safetensors")
    reloaded = validation_loss(model, batches=4, batch_size=4, context=cfg.context)
    assert abs(reloaded - evals[-1]) < 1e-4, (reloaded, evals[-1])


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    cmd = ravn_cmd(
        "local",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "interrupted",
        "--peers",
        "3",
        "--steps",
        "100000",
        "--eval-every",
        "0",
    )
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    marker, lines = None, []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"coordinator on (127\.0\.0\.1:\d+)", line)
            if m:
                marker = f"--coordinator {m.group(1)}"
            if line.startswith("step "):
                break
        assert marker and lines[-1].startswith("step "), "".join(lines)
        assert len(processes_with(marker)) == 3
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, "".join(lines) + out
    assert "interrupted" in out
    assert "checkpoint:" in out, "an interrupted run still saves its last complete step"
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(marker) == [], "peer processes survived Ctrl-C"
