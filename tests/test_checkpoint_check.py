"""The checkpoint preflight: every way a checkpoint directory can be wrong is one CheckpointError line naming it.

The same errors reach a peer whose local copy differs: ``HFStageModel`` raises them when it loads its block.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from swarm.train.hf import HFStageModel, checkpoint_check, hf_model_config  # noqa: E402
from swarm.train.hf.checkpoint_check import (  # noqa: E402
    INDEX_FILE,
    CheckpointError,
    check_checkpoint,
    check_lora_targets,
    default_context,
)
from swarm.train.hf.tiny import ARCHS, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {arch: make_tiny_checkpoint(root / arch, arch, n_layers=2) for arch in ARCHS}
    out["sharded"] = make_tiny_checkpoint(root / "sharded", "llama", n_layers=2, max_shard_size="40KB")
    return out


def copy(originals: dict[str, Path], tmp_path: Path, which: str = "llama") -> Path:
    return Path(shutil.copytree(originals[which], tmp_path / which))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def refused(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("arch", [*ARCHS, "sharded"])
def test_good_checkpoints_pass(originals, arch):
    check_checkpoint(originals[arch])
    assert default_context(originals[arch]) == 128  # min(512, max_position_embeddings)


def test_no_directory_and_no_config(tmp_path):
    refused(tmp_path / "nowhere", "nowhere", "no such checkpoint directory")
    refused(tmp_path, str(tmp_path / "config.json"), "missing")


def test_config_not_json_or_incomplete(originals, tmp_path):
    ckpt = copy(originals, tmp_path)
    (ckpt / "config.json").write_text("{not json")
    refused(ckpt, "config.json", "not valid JSON")
    (ckpt / "config.json").write_text("[]")
    refused(ckpt, "config.json", "not a JSON object")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320}))
    refused(ckpt, "config.json", "lacks 'hidden_size'")
    (ckpt / "config.json").write_text(json.dumps({"hidden_size": 64}))
    refused(ckpt, "config.json", "no model_type")


@pytest.mark.parametrize("model_type", ["t5", "bert", "gemma"])
def test_unsupported_architecture_lists_the_supported(originals, tmp_path, model_type):
    ckpt = copy(originals, tmp_path)
    edit_config(ckpt, model_type=model_type)
    refused(ckpt, "config.json", repr(model_type), "llama, mistral, qwen2, gpt2")


def test_pickled_weights_only(originals, tmp_path):
    ckpt = copy(originals, tmp_path)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x02 pickled")
    refused(ckpt, "pytorch_model.bin", "convert them to safetensors")
    (ckpt / "pytorch_model.bin").unlink()
    refused(ckpt, "no *.safetensors")


def test_no_tokenizer(originals, tmp_path):
    ckpt = copy(originals, tmp_path)
    (ckpt / "tokenizer.json").unlink()
    refused(ckpt, str(ckpt), "has no tokenizer")


def test_missing_shard(originals, tmp_path):
    ckpt = copy(originals, tmp_path, "sharded")
    index = json.loads((ckpt / INDEX_FILE).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (ckpt / last).unlink()
    refused(ckpt, str(ckpt / last), "is missing", INDEX_FILE)
    with pytest.raises(CheckpointError, match="is missing"):  # a peer with this copy: the same error
        HFStageModel(ckpt, 0, 1)


def test_bad_index(originals, tmp_path):
    ckpt = copy(originals, tmp_path, "sharded")
    (ckpt / INDEX_FILE).write_text('{"metadata": {}}')
    refused(ckpt, INDEX_FILE, "not a valid safetensors index")


def test_index_names_a_tensor_its_shard_lacks(originals, tmp_path):
    ckpt = copy(originals, tmp_path, "sharded")
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = next(iter(index["weight_map"].values()))
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    refused(ckpt, "has no tensor model.layers.0.extra.weight")


def test_truncated_or_corrupt_shard(originals, tmp_path):
    ckpt = copy(originals, tmp_path)
    shard = ckpt / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    refused(ckpt, str(shard), "truncated or corrupt")
    shard.write_bytes(b"\xff" * 64)
    refused(ckpt, str(shard), "truncated or corrupt")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        HFStageModel(ckpt, 0, 1)


def test_missing_tensor(originals, tmp_path):
    ckpt = copy(originals, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    refused(ckpt, "lacks tensor model.layers.1.mlp.down_proj.weight")
    with pytest.raises(CheckpointError, match="lacks tensor model.layers.1.mlp.down_proj.weight"):
        HFStageModel(ckpt, 1, 2)


@pytest.mark.parametrize(
    ("arch", "name"),
    [
        ("llama", "model.layers.1.self_attn.q_proj.weight"),
        ("llama", "model.embed_tokens.weight"),
        ("llama", "lm_head.weight"),
        ("llama", "model.norm.weight"),
        ("gpt2", "transformer.h.0.attn.c_attn.weight"),
        ("gpt2", "transformer.wpe.weight"),
    ],
)
def test_wrong_shape_names_the_tensor_and_both_shapes(originals, tmp_path, arch, name):
    ckpt = copy(originals, tmp_path, arch)
    tensors = load_file(ckpt / "model.safetensors")
    good = list(tensors[name].shape)
    bad = [good[0] + 1, *good[1:]]
    tensors[name] = torch.zeros(bad, dtype=tensors[name].dtype)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    refused(ckpt, str(ckpt / "model.safetensors"), name, str(bad), str(good))


def test_wrong_shape_reaches_a_peer_as_the_same_error(originals, tmp_path):
    ckpt = copy(originals, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = torch.zeros(3, 64)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[3, 64\]"):
        HFStageModel(ckpt, 0, 1)


def test_context_beyond_the_positions_names_the_limit(originals):
    with pytest.raises(CheckpointError, match=r"context 512 exceeds the 128 positions of .*config\.json"):
        hf_model_config(originals["llama"], 512)
    assert hf_model_config(originals["llama"], 128).context == 128


def test_reads_headers_only(originals, monkeypatch):
    """No tensor data is read: checking a 70B checkpoint costs what its headers cost."""
    real = checkpoint_check.safe_open

    class HeadersOnly:  # safe_open with nothing but the names and shapes of its tensors
        def __init__(self, *args, **kwargs) -> None:
            self._file = real(*args, **kwargs)

        def __enter__(self):
            self._open = self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._open.keys()

        def get_slice(self, name):
            return SimpleNamespace(get_shape=self._open.get_slice(name).get_shape)

    monkeypatch.setattr(checkpoint_check, "safe_open", HeadersOnly)
    check_checkpoint(originals["sharded"])
    check_checkpoint(originals["gpt2"])


def test_lora_targets_must_name_projections_of_the_layers(originals):
    check_lora_targets(originals["llama"], ("q_proj", "v_proj"))
    check_lora_targets(originals["gpt2"], ())
    with pytest.raises(
        CheckpointError, match=r"--lora-targets qkv: no such projection in a gpt2 layer; choose from c_attn"
    ):
        check_lora_targets(originals["gpt2"], ("c_attn", "qkv"))
