"""HFStageModel drops into StageRunner through its ``model`` argument."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch  # noqa: E402
import typer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import swarm.train.stage_runner as stage_runner  # noqa: E402
from coordinator.options import RunOptions, with_train_options  # noqa: E402
from swarm.config import TrainConfig  # noqa: E402
from swarm.train.hf import HFStageModel, TokenCorpus, hf_model_config  # noqa: E402
from swarm.train.hf.tiny import SAMPLE_TEXT, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_two_stage_runners_fine_tune_an_hf_checkpoint(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    (tmp_path / "notes.txt").write_text(" ".join(SAMPLE_TEXT) * 20)
    corpus = TokenCorpus.load(tmp_path / "notes.txt", path)
    context = 32
    model_cfg = hf_model_config(path, context)
    train_cfg = TrainConfig(micro_batches=2, micro_batch_size=4, lr=1e-2, warmup_steps=0, weight_decay=0.0)

    def block(start: int, end: int) -> HFStageModel:
        return HFStageModel(path, start, end, dtype=torch.float32, lora_rank=4)

    first = stage_runner.StageRunner(model_cfg, train_cfg, 0, 2, model=block(0, 2))
    last = stage_runner.StageRunner(model_cfg, train_cfg, 2, 4, model=block(2, 4))
    assert isinstance(first.model, HFStageModel) and last.is_last

    losses = []
    for step in range(12):
        total, tokens = 0.0, 0
        for i in range(train_cfg.micro_batches):
            ids, targets = corpus.batch(split="train", seed=0, step=step, index=i, batch_size=4, context=context)
            mb = step * 10 + i
            hidden = first.forward(mb, ids).output
            result = last.forward(mb, hidden, targets)
            stepped = first.backward(mb, result.input_grad).stepped
            assert stepped == result.stepped == (i == train_cfg.micro_batches - 1)
            total, tokens = total + result.loss_sum, tokens + result.tokens
        losses.append(total / tokens)
    assert first.version == last.version == 12
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.3, losses


@pytest.mark.parametrize("recompute", [False, True], ids=["graph", "activation-checkpointing"])
def test_a_stale_lora_backward_uses_the_adapters_its_forward_saw_and_keeps_only_them(tmp_path, recompute):
    """A stale gradient goes through the adapters its forward saw, also when activation checkpointing
    recomputes the layers in the backward; the frozen base is shared by every version, so keeping it would
    only cost memory, and a gradient on it would be a full-size tensor nothing clears."""
    path = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    (tmp_path / "notes.txt").write_text(" ".join(SAMPLE_TEXT) * 20)
    corpus = TokenCorpus.load(tmp_path / "notes.txt", path)
    train_cfg = TrainConfig(
        micro_batches=2,
        micro_batch_size=2,
        lr=1e-2,
        warmup_steps=0,
        weight_decay=0.0,
        schedule="async",
        max_staleness=1,
    )
    block = HFStageModel(path, 0, 2, dtype=torch.float32, lora_rank=4, activation_checkpointing=recompute)
    runner = stage_runner.StageRunner(hf_model_config(path, 16), train_cfg, 0, 2, model=block)
    frozen = [p for p in runner.model.parameters() if not p.requires_grad]
    assert frozen and runner.trainable
    ids = [corpus.batch(split="train", seed=0, step=0, index=i, batch_size=2, context=16)[0] for i in range(3)]
    grad_out = [
        torch.randn(2, 16, runner.model_cfg.d_model, generator=torch.Generator().manual_seed(i)) for i in range(3)
    ]
    version0 = copy.deepcopy(runner.model)
    version0.activation_checkpointing = False

    for mb in range(3):
        runner.forward(mb, ids[mb])
    assert not runner.backward(0, grad_out[0]).stepped
    assert runner.backward(1, grad_out[1]).stepped  # version 1; micro-batch 2 ran its forward on version 0
    adapter_bytes = sum(p.numel() * p.element_size() for p in runner.trainable)
    assert runner.metrics.kept_weights_bytes_peak == adapter_bytes
    assert runner.backward(2, grad_out[2]).staleness == 1

    version0(ids[2]).backward(grad_out[2])
    expected = {n: p.grad for n, p in version0.named_parameters() if p.requires_grad}
    for name, p in runner.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, expected[name], msg=name)
        else:
            assert p.grad is None, f"frozen {name} got a gradient"
    assert all(not p.requires_grad for p in frozen)


def test_lora_rank_0_is_a_frozen_block_that_no_run_accepts(tmp_path):
    """docs/finetune.md: rank 0 builds a frozen block (evaluation, split checks); a swarm run must train."""
    path = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    block = HFStageModel(path, 0, 2, dtype=torch.float32, lora_rank=0)
    assert not any(p.requires_grad for p in block.parameters())
    assert not block(torch.zeros(1, 4, dtype=torch.long)).requires_grad
    with pytest.raises(ValueError, match="no trainable parameters"):
        stage_runner.StageRunner(hf_model_config(path, 16), TrainConfig(), 0, 2, model=block)

    app = typer.Typer()

    @app.command()
    @with_train_options
    def serve(options: RunOptions) -> None:
        raise AssertionError("a rank-0 run must be refused before it starts")

    result = CliRunner().invoke(app, ["--model", str(path), "--lora-rank", "0"])
    assert result.exit_code == 2 and "--lora-rank" in result.output, result.output
