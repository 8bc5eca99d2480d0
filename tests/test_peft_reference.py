"""Ravn's LoRA fine-tuning over 3 real peer processes against a reference Ravn did not write.

The reference (``benchmarks/peft_reference.py``) is a plain single-process transformers + peft loop
(``get_peft_model``, ``LoraConfig``, torch AdamW) with Ravn's data order, loss normalisation, optimizer,
schedule and initial adapters. With fp32 wires and the sync schedule every per-step loss must agree to
1e-4, with an fp32 and with a bf16 base (both agree exactly on this machine: the same kernels in the same
order; hidden states cross the wire as fp32, which a bf16 value survives exactly, and a LoRA delta is added
in fp32 and rounded once, as peft does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from benchmarks.peft_reference import Recipe, Result, compare, ravn_steps, side_by_side, train  # noqa: E402
from swarm.train.hf.tiny import make_tiny_checkpoint  # noqa: E402
from tests.conftest import run_ravn_local  # noqa: E402


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_ravn_lora_matches_a_peft_loop_step_for_step(tmp_path: Path, dtype: str) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "llama", "llama")
    data = tmp_path / "qa.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Q{i % 7}: after {i % 10}?", "completion": f" {i % 10 + 1}."}) + "\n"
            for i in range(200)
        )
    )
    recipe = Recipe(
        steps=5, micro_batches=3, micro_batch_size=4, context=32, lr=1e-2, lora_rank=8, lora_alpha=16, dtype=dtype
    )
    run_ravn_local(
        tmp_path,
        "lora",
        *("--peers", "3", "--model", str(ckpt), "--finetune", "lora", "--dtype", dtype, "--data", str(data)),
        *("--steps", str(recipe.steps), "--micro-batches", str(recipe.micro_batches)),
        *("--micro-batch-size", str(recipe.micro_batch_size), "--context", str(recipe.context)),
        *("--lr", str(recipe.lr), "--lora-rank", str(recipe.lora_rank), "--lora-alpha", str(recipe.lora_alpha)),
        *("--seed", str(recipe.seed), "--eval-every", "0", "--eval-batches", "1"),
        *("--schedule", "sync", "--wire-forward", "fp32", "--wire-backward", "fp32", "--grad-clip", "0"),
    )
    ravn = ravn_steps(tmp_path / "lora")
    reference = train(ckpt, data, recipe, threads=1)
    assert len(ravn.losses) == recipe.steps
    result = compare(ravn, reference)
    assert result["tokens_equal"], (ravn.tokens, reference.tokens)
    assert result["max_abs_diff"] <= 1e-4, list(zip(ravn.losses, reference.losses, strict=True))
    assert reference.losses[-1] < reference.losses[0]  # it trained: the agreement is not of two idle runs


def test_a_ravn_step_without_a_loss_is_counted_not_compared(tmp_path: Path) -> None:
    """A step none of whose micro-batches came through has ``loss: null`` in metrics.jsonl; the comparison
    names it instead of failing on it, and the side-by-side table shows it as '-'."""
    rows = [
        {"kind": "step", "step": 0, "loss": 2.0, "tokens": 8, "seconds": 0.1},
        {"kind": "step", "step": 1, "loss": None, "tokens": 0, "seconds": 0.1},
        {"kind": "step", "step": 2, "loss": 1.5, "tokens": 8, "seconds": 0.1},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ravn = ravn_steps(tmp_path)
    ref = Result(losses=[2.0, 1.8, 1.2], tokens=[8, 8, 8], seconds=[0.1, 0.1, 0.1])
    got = compare(ravn, ref)
    assert got["steps"] == 3 and got["steps_without_loss"] == 1 and not got["tokens_equal"]
    assert got["max_abs_diff"] == pytest.approx(0.3) and got["last_rel_diff"] == pytest.approx(0.25)
    assert "| 1 | - | 1.800000 | - |" in side_by_side(ravn, ref)
