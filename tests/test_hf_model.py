"""HFStageModel: pipeline blocks of real HF architectures match the unsplit transformers model, and a
peer reads only its own block's tensors from the safetensors shards."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import swarm.train.hf.loader as loader  # noqa: E402
from swarm.train.hf import HFStageModel, hf_model_config  # noqa: E402
from swarm.train.hf.checkpoint_check import CheckpointError  # noqa: E402
from swarm.train.hf.tiny import ARCHS, make_tiny_checkpoint  # noqa: E402

SPLIT = [(0, 1), (1, 3), (3, 4)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core box OpenMP spinning makes them 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {arch: make_tiny_checkpoint(root / arch, arch) for arch in ARCHS}
    out["llama-sharded"] = make_tiny_checkpoint(root / "llama-sharded", "llama", max_shard_size="40KB")
    return out


def reference_logits(path: Path, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(ids).logits


def chained_logits(path: Path, ids: torch.Tensor, split=SPLIT, **kwargs) -> torch.Tensor:
    h = ids
    with torch.no_grad():
        for start, end in split:
            h = HFStageModel(path, start, end, dtype=torch.float32, **kwargs)(h)
    return h


@pytest.mark.parametrize("arch", [*ARCHS, "llama-sharded"])
def test_split_blocks_match_the_full_model(checkpoints, arch):
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    ref = reference_logits(checkpoints[arch], ids)
    for split in (SPLIT, [(0, 4)]):  # three peers, and one peer holding everything (tied head shares storage)
        torch.testing.assert_close(chained_logits(checkpoints[arch], ids, split), ref, atol=1e-5, rtol=1e-5)


def test_eager_attention_builds_its_causal_mask(checkpoints):
    """Layers built outside a PreTrainedModel have no attention kernel set; eager needs an explicit mask."""
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(4))
    for arch in ("llama", "mistral", "gpt2"):
        ref = reference_logits(checkpoints[arch], ids)
        got = chained_logits(checkpoints[arch], ids, attn_implementation="eager")
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_mistral_sliding_window_is_applied(checkpoints):
    """T=20 > window 8: our blocks must differ from a full-causal Mistral, i.e. the window mask is used."""
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    full_causal = reference_logits(checkpoints["mistral"], ids, sliding_window=None)
    assert (chained_logits(checkpoints["mistral"], ids) - full_causal).abs().max() > 1e-4


class _SpyRead:
    """Wraps ``loader.read_tensor`` to record every tensor actually read out of a shard."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []
        self.read = loader.read_tensor

    def __call__(self, shard, name):
        self.reads.append((Path(shard).name, name))
        return self.read(shard, name)


@pytest.mark.parametrize(
    ("arch", "block", "expected_extra"),
    [
        ("llama-sharded", (1, 3), set()),
        ("llama-sharded", (0, 1), {"model.embed_tokens.weight"}),
        ("llama-sharded", (3, 4), {"model.norm.weight", "lm_head.weight"}),
        ("qwen2", (3, 4), {"model.norm.weight", "model.embed_tokens.weight"}),  # tied: head = embedding matrix
        ("gpt2", (0, 2), {"transformer.wte.weight", "transformer.wpe.weight"}),
        ("gpt2", (2, 4), {"transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.wte.weight"}),
    ],
)
def test_a_peer_reads_only_its_block(checkpoints, monkeypatch, arch, block, expected_extra):
    path = checkpoints[arch]
    spy = _SpyRead()
    monkeypatch.setattr(loader, "read_tensor", spy)
    model = HFStageModel(path, *block, dtype=torch.float32)
    layer_prefix = model.arch.layer_prefix
    all_names = set(loader.CheckpointReader(path).names())
    expected = {n for n in all_names if any(n.startswith(f"{layer_prefix}{i}.") for i in range(*block))}
    expected |= expected_extra
    read = [name for _, name in spy.reads]
    assert len(read) == len(set(read)), "a tensor was read twice"
    assert set(read) == expected
    assert len(expected) < len(all_names)
    if arch == "llama-sharded":  # only the shards holding those tensors were opened for reading
        weight_map = json.loads((path / loader.INDEX_FILE).read_text())["weight_map"]
        assert {f for f, _ in spy.reads} == {weight_map[n] for n in expected}


def test_shards_without_an_index_and_unprefixed_gpt2_names(checkpoints, tmp_path):
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    no_index = tmp_path / "no-index"
    shutil.copytree(checkpoints["llama-sharded"], no_index)
    (no_index / loader.INDEX_FILE).unlink()
    ref = reference_logits(checkpoints["llama-sharded"], ids)
    torch.testing.assert_close(chained_logits(no_index, ids), ref, atol=1e-5, rtol=1e-5)

    # OpenAI's original gpt2 files name tensors without the "transformer." prefix
    bare = tmp_path / "gpt2-bare"
    shutil.copytree(checkpoints["gpt2"], bare)
    with safe_open(str(bare / "model.safetensors"), framework="pt") as f:
        tensors = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(bare / "model.safetensors"), metadata={"format": "pt"})
    torch.testing.assert_close(
        chained_logits(bare, ids), reference_logits(checkpoints["gpt2"], ids), atol=1e-5, rtol=1e-5
    )


def test_stage_interface_and_errors(checkpoints):
    path = checkpoints["llama"]
    first, mid = HFStageModel(path, 0, 2), HFStageModel(path, 2, 3)  # bf16 compute by default
    assert first.is_first and not first.is_last and not mid.is_first and not mid.is_last
    assert first.input_shape(2, 8) == (2, 8) and mid.input_shape(2, 8) == (2, 8, 64)
    ids = torch.randint(0, 300, (2, 8))
    h = first(ids)
    assert h.dtype == torch.float32 and h.shape == (2, 8, 64)  # the wire gets fp32 whatever the compute dtype
    assert mid(h).dtype == torch.float32
    assert not any(p.requires_grad for p in first.parameters())  # lora_rank=0: a frozen block
    with pytest.raises(ValueError, match="token ids"):
        first(h)
    with pytest.raises(ValueError, match="hidden states"):
        mid(ids)
    with pytest.raises(ValueError, match="positions"):
        first(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="invalid block"):
        HFStageModel(path, 3, 5)
    cfg = hf_model_config(path, context=64)
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.context) == (4, 64, first.vocab_size, 64)
    with pytest.raises(ValueError, match="exceeds"):
        hf_model_config(path, context=4096)


def test_unsupported_architecture_is_refused(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["llama"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "gemma"
    config["architectures"] = ["GemmaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'gemma' is not supported"):
        HFStageModel(bad, 0, 1)
    with pytest.raises(CheckpointError, match="config.json is missing"):
        HFStageModel(tmp_path, 0, 1)
