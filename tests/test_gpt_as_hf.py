"""The fine-tuning benchmark's checkpoint: a built-in GPT as GPT-2 computes the same logits on the same ids."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from benchmarks.gpt_as_hf import convert  # noqa: E402
from swarm.config import MODEL_PRESETS, ModelConfig  # noqa: E402
from swarm.train.hf import load_tokenizer  # noqa: E402
from swarm.train.model import full_model  # noqa: E402


def test_the_gpt2_copy_computes_the_same_logits_and_reads_text_as_bytes(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    cfg = ModelConfig(**{**MODEL_PRESETS["gpt-tiny"].__dict__, "seed": 3})
    ours = full_model(cfg)
    with torch.no_grad():  # biases and norms away from their init, so a swapped or untransposed one shows
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = convert(ours.state_dict(), cfg, tmp_path / "ckpt")
    theirs = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    ids = torch.randint(0, 256, (2, cfg.context))
    with torch.no_grad():
        want, got = ours(ids), theirs(ids).logits
    assert got.shape == (2, cfg.context, 257)
    torch.testing.assert_close(got[..., :256], want, rtol=1e-4, atol=1e-4)
    tok = load_tokenizer(out)
    text = "héllo\n\tworld"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.eos_token_id == 256
