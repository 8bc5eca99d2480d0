"""``ravn local`` as a user runs it: the loss falls, artefacts appear, the checkpoint reloads, Ctrl-C is clean."""

import re
import signal
from pathlib import Path

import torch

from swarm.allocator import preload_library
from swarm.train.checkpoint import load_checkpoint
from swarm.train.data import Corpus
from tests.conftest import ravn_cmd, read_metrics, run_ravn_local
from tests.swarm_procs import Proc, assert_all_gone


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
        tmp_path,
        "short",
        "--peers",
        "3",
        "--steps",
        "60",
        "--eval-every",
        "30",
        "--eval-batches",
        "4",
        "--wire-forward",
        "fp32",
        "--wire-backward",
        "fp32",
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
    lib = preload_library() or "glibc"  # every peer runs on jemalloc or tcmalloc when installed (swarm/allocator.py)
    expected = next(name for name in ("jemalloc", "tcmalloc", "glibc") if name in lib)
    summary = next(m for m in metrics if m["kind"] == "summary")
    assert {st["memory"]["allocator"] for st in summary["stages"]} == {expected}, summary["stages"]

    model, cfg = load_checkpoint(run_dir / "model.safetensors")
    reloaded = validation_loss(model, batches=4, batch_size=4, context=cfg.context)
    assert abs(reloaded - evals[-1]) < 1e-4, (reloaded, evals[-1])


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    proc = Proc(
        ravn_cmd(
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
    )
    try:
        proc.wait_for(r"^step \d+/", 180)
        tree = proc.tree()
        assert len(tree) >= 1 + 3 + 4 * 2, "ravn, 3 peers, and a DHT process with its p2pd for each of the 4"
        proc.popen.send_signal(signal.SIGINT)
        assert proc.wait(90) == 130, proc.output
    finally:
        proc.stop()
    assert "interrupted" in proc.output
    assert "checkpoint:" in proc.output, "an interrupted run still saves its last complete step"
    assert_all_gone(tree)
