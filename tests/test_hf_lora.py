"""LoRA on HF blocks: identity at init, training moves only adapters and lowers the loss across a split,
and the adapters round-trip through peft on the full model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from swarm.train.hf import HFStageModel, TokenCorpus, adapter_settings, save_peft_adapter  # noqa: E402
from swarm.train.hf.tiny import make_tiny_checkpoint  # noqa: E402

SPLIT = [(0, 2), (2, 4)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core box OpenMP spinning makes them 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-lora")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, checkpoints) -> TokenCorpus:
    path = tmp_path_factory.mktemp("data") / "qa.jsonl"
    rows = [
        {"prompt": f"Question: what is {a} plus {b}? Answer:", "completion": f" {a + b}."}
        for a in range(4)
        for b in range(3)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return TokenCorpus.load(path, checkpoints["llama"])


def stages(path: Path, **kwargs) -> list[HFStageModel]:
    return [HFStageModel(path, a, b, dtype=torch.float32, **kwargs) for a, b in SPLIT]


def run(blocks: list[HFStageModel], ids: torch.Tensor) -> torch.Tensor:
    h = ids
    for block in blocks:
        h = block(h)
    return h


def pipeline_step(blocks: list[HFStageModel], ids: torch.Tensor, targets: torch.Tensor) -> float:
    """Forward and backward the way StageRunner does it: each stage sees a detached input and gets dL/d(out)."""
    inputs, outputs, h = [], [], ids
    for block in blocks:
        x = h if block.is_first else h.detach().requires_grad_(True)
        h = block(x)
        inputs.append(x)
        outputs.append(h)
    loss = blocks[-1].loss_sum(h, targets) / int((targets != -100).sum())
    loss.backward()
    for i in range(len(blocks) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)
    return float(loss.detach())


def randomise_adapters(blocks: list[HFStageModel], seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in blocks:
            for p in block.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_adapters_start_as_identity_and_are_the_only_trainable_tensors(checkpoints):
    path = checkpoints["llama"]
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    lora = stages(path, lora_rank=4)
    with torch.no_grad():
        assert torch.equal(run(lora, ids), run(stages(path), ids))
    trainable = {n for b in lora for n, p in b.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    names = set(lora[0].trainable_state_dict())
    assert "model.layers.1.mlp.down_proj.lora_B.weight" in names  # global HF names, all 7 projections
    assert len(names) == 2 * 7 * 2 and not any(n.startswith("model.layers.2.") for n in names)
    # the same adapters whatever the split: init depends only on (seed, global module name)
    whole = HFStageModel(path, 0, 4, dtype=torch.float32, lora_rank=4)
    sd = whole.trainable_state_dict()
    for block in lora:
        for name, t in block.trainable_state_dict().items():
            assert torch.equal(t, sd[name])


@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_training_lowers_the_loss_and_changes_only_adapters(checkpoints, corpus, quant):
    torch.manual_seed(0)
    blocks = stages(checkpoints["llama"], lora_rank=8, lora_alpha=16, quant=quant)
    frozen = [{k: v.clone() for k, v in b.state_dict().items() if "lora_" not in k} for b in blocks]
    before = [b.trainable_state_dict() for b in blocks]
    params = [p for b in blocks for p in b.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(30):
        ids, targets = corpus.batch(split="train", seed=0, step=step, index=0, batch_size=4, context=48)
        losses.append(pipeline_step(blocks, ids, targets))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    for b, fz, bf in zip(blocks, frozen, before, strict=True):
        assert all(torch.equal(v, b.state_dict()[k]) for k, v in fz.items())  # base untouched
        after = b.trainable_state_dict()
        assert all(not torch.equal(after[k], v) for k, v in bf.items() if ".lora_B." in k)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_adapters_round_trip_through_peft(checkpoints, tmp_path, arch):
    path = checkpoints[arch]
    blocks = stages(path, lora_rank=4, lora_alpha=8)
    randomise_adapters(blocks)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = run(blocks, ids)
        base = run(stages(path), ids)
    assert (ours - base).abs().max() > 1e-2  # the adapters do something

    # the coordinator's merge: union of every stage's adapters -> one peft directory for the full model
    merged = {k: v for b in blocks for k, v in b.trainable_state_dict().items()}
    settings = adapter_settings(path, rank=4, alpha=8)  # what the coordinator knows: config.json and the run args
    assert settings == blocks[0].adapter_settings()
    adapter = save_peft_adapter(merged, tmp_path / "adapter", **settings)
    full = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(full, str(adapter)).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, ours, atol=1e-5, rtol=1e-5)

    # one block's own save: peft puts adapters on that block's layers only, and it loads back into a block
    blocks[1].save_adapter(tmp_path / "block1")
    partial = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path)), str(tmp_path / "block1"))
    lora_layers = {
        int(n.split(".h." if arch == "gpt2" else ".layers.")[1].split(".")[0])
        for n, _ in partial.named_modules()
        if n.endswith("lora_A")
    }
    assert lora_layers == {2, 3}
    fresh = HFStageModel(path, 2, 4, dtype=torch.float32, lora_rank=4, lora_alpha=8, seed=7)
    fresh.load_adapter(tmp_path / "block1")
    h = blocks[0](ids)
    with torch.no_grad():
        torch.testing.assert_close(fresh(h), blocks[1](h))
