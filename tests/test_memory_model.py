"""The memory model against reality: the bytes autograd saves in one real decoder layer, and the weights an
``HFStageModel`` block really holds, on tiny checkpoints (no download)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

from coordinator.memory_model import (  # noqa: E402
    Arch,
    Settings,
    block_memory,
    in_flight_layer_bytes,
    last_layer_memory,
    layer_activation_bytes,
    layer_adapter_bytes,
    layer_flops,
    layer_memory,
    min_memory_for,
    stage_overhead_bytes,
)
from swarm.train.hf.lora import attach_lora  # noqa: E402
from swarm.train.hf.quant import Int8Linear  # noqa: E402

TOLERANCE = 0.10
# (batch, context, hidden, heads, kv heads, intermediate): MHA and GQA, T above and below head_dim
LLAMA_SHAPES = [(2, 24, 64, 4, 2, 96), (1, 40, 96, 6, 6, 256), (3, 17, 128, 8, 2, 344), (2, 64, 64, 2, 1, 128)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def saved_bytes(layer: torch.nn.Module, run) -> int:
    """Bytes of the tensors autograd saves during ``run()``, each storage once, the module's own excluded."""
    own = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    assert out.requires_grad
    return sum(seen.values())


def llama_layer(shape, dtype: torch.dtype, rank: int, *, int8: bool = False):
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    batch, t, d, heads, kv, inter = shape
    config = LlamaConfig(
        hidden_size=d,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=100,
        num_hidden_layers=1,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    layer = LlamaDecoderLayer(config, 0).to(dtype).requires_grad_(False)
    if int8:  # as HFStageModel(quant="int8"): the backward keeps only the int8 weight, which is a buffer
        for name, child in list(layer.named_modules()):
            if isinstance(child, torch.nn.Linear):
                layer.set_submodule(name, Int8Linear.from_weight(child.weight, child.bias, dtype=dtype))
    if rank:
        attach_lora(layer, targets=Arch.from_config(config).default_targets(), rank=rank, alpha=16, name_prefix="l.")
    rotary = LlamaRotaryEmbedding(config=config)
    x = torch.randn(batch, t, d, requires_grad=True)

    def call(h, pos, rope):
        mask = create_causal_mask(config, h, None, None, position_ids=pos)
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return out[0] if isinstance(out, tuple) else out

    def run(checkpointed: bool = False):
        h, pos = x.to(dtype), torch.arange(t)[None]  # as HFStageModel.forward: fp32 in, compute dtype inside
        rope = rotary(h, pos)  # once per block, shared by its layers
        if checkpointed:  # as HFStageModel with activation checkpointing
            return torch.utils.checkpoint.checkpoint(call, h, pos, rope, use_reentrant=False)
        return call(h, pos, rope)

    return config, layer, run


@pytest.mark.parametrize("shape", LLAMA_SHAPES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rank", [0, 8])
def test_llama_layer_activations_match_what_autograd_saves(shape, dtype, rank):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    config, layer, run = llama_layer(shape, torch_dtype, rank)
    measured = saved_bytes(layer, run)
    settings = Settings(dtype=dtype, lora_rank=rank, micro_batch_size=shape[0], context=shape[1])
    predicted = layer_activation_bytes(Arch.from_config(config), settings)
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_int8_base_saves_the_same_activations(dtype):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    config, layer, run = llama_layer(LLAMA_SHAPES[0], torch_dtype, 8, int8=True)
    settings = Settings(dtype=dtype, quant="int8", lora_rank=8, micro_batch_size=2, context=24)
    predicted = layer_activation_bytes(Arch.from_config(config), settings)
    measured = saved_bytes(layer, run)
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_checkpointing_keeps_only_the_layer_input(dtype):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    shape = LLAMA_SHAPES[2]
    config, layer, run = llama_layer(shape, torch_dtype, 8)
    settings = Settings(dtype=dtype, lora_rank=8, micro_batch_size=shape[0], context=shape[1], in_flight=1)
    measured = saved_bytes(layer, lambda: run(checkpointed=True))  # the input and the position ids
    predicted = in_flight_layer_bytes(Arch.from_config(config), replace(settings, activation_checkpointing=True))
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)
    full = saved_bytes(layer, run)
    assert measured < full / 8


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rank", [0, 8])
def test_gpt2_block_activations_match_what_autograd_saves(dtype, rank):
    from transformers import GPT2Config
    from transformers.masking_utils import create_causal_mask
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    config = GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=128, attn_implementation="sdpa")
    for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
        setattr(config, key, 0.0)
    layer = GPT2Block(config, layer_idx=0).to(torch_dtype).requires_grad_(False)
    if rank:
        attach_lora(layer, targets=("c_attn", "c_proj", "c_fc"), rank=rank, alpha=16, name_prefix="l.")
    x = torch.randn(2, 24, 64, requires_grad=True)

    def run():
        h = x.to(torch_dtype)
        mask = create_causal_mask(config, h, None, None, position_ids=torch.arange(24)[None])
        out = layer(h, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    measured = saved_bytes(layer, run)
    predicted = layer_activation_bytes(
        Arch.from_config(config), Settings(dtype=dtype, lora_rank=rank, micro_batch_size=2, context=24)
    )
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from swarm.train.hf.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("memory-model")
    # hidden 96: NF4 rows of 96 values are padded to 128, so the padding is counted too
    return {arch: make_tiny_checkpoint(root / arch, arch, hidden=96) for arch in ("llama", "qwen2", "gpt2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_block_weights_match_the_stage_model(checkpoints, arch, quant):
    """Base + embedding/head bytes equal ``weight_bytes()`` exactly (NF4 rows padded to 64 included)."""
    from swarm.train.hf import HFStageModel

    path = checkpoints[arch]
    spec = Arch.from_path(path)
    settings = Settings(dtype="bf16", quant=quant, lora_rank=4)
    for start, end in [(0, 2), (2, 4), (1, 3), (0, 4)]:
        block = HFStageModel(path, start, end, dtype="bf16", quant=quant, lora_rank=4)
        predicted = block_memory(spec, settings, start, end)
        assert predicted.base + predicted.ends == block.weight_bytes(), (start, end)
        adapters = sum(p.numel() for p in block.parameters() if p.requires_grad)
        assert predicted.adapters == 16 * adapters == (end - start) * layer_adapter_bytes(spec, settings)


def test_config_file_or_directory_and_clear_errors(checkpoints, tmp_path):
    path = checkpoints["llama"]
    assert Arch.from_path(path) == Arch.from_path(path / "config.json")
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ValueError, match="t5"):
        Arch.from_path(tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        Arch.from_path(tmp_path / "missing")


def test_per_layer_memory_sums_to_blocks_and_puts_the_ends_on_the_end_layers():
    arch = Arch.from_path(Path(__file__).resolve().parent.parent / "docs" / "configs" / "llama-3-70b.json")
    s = Settings(quant="nf4")
    per = layer_memory(arch, s)
    assert per[0] > per[1] == per[40] < per[-1]
    head = block_memory(arch, s, 0, 40)
    assert head.total - sum(per[:40]) == pytest.approx(stage_overhead_bytes(arch, s))  # per block, not per layer
    one = replace(s, in_flight=1)  # the last block keeps one micro-batch at a time
    tail = block_memory(arch, s, 40, 80)
    assert tail.total - sum(last_layer_memory(arch, s)[40:]) == pytest.approx(stage_overhead_bytes(arch, one))
    assert tail.activations < block_memory(arch, s, 39, 79).activations
    assert min_memory_for(arch, s, 4) == max(block_memory(arch, s, 0, 4).total, block_memory(arch, s, 76, 80).total)
    checkpointed = Settings(quant="nf4", activation_checkpointing=True)
    assert layer_flops(arch, checkpointed) > layer_flops(arch, s)
    assert in_flight_layer_bytes(arch, checkpointed) < in_flight_layer_bytes(arch, s) / 10
