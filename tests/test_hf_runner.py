"""HFStageModel drops into StageRunner through its ``model`` argument."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch  # noqa: E402

import swarm.stage_runner as stage_runner  # noqa: E402
from swarm.config import TrainConfig  # noqa: E402
from swarm.hf import HFStageModel, TokenCorpus, hf_model_config  # noqa: E402
from swarm.hf.tiny import SAMPLE_TEXT, make_tiny_checkpoint  # noqa: E402


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
