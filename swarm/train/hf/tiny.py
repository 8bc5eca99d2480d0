"""Tiny random Hugging Face checkpoints (model + tokenizer) built offline, for tests and dry runs.

Fine-tuning code must be testable without downloading gigabytes, and a new user should be able to
try ``ravn`` on a real HF directory layout in seconds. These checkpoints are written by
``transformers`` itself (``save_pretrained``, safetensors, optionally sharded with an index), with a
byte-level BPE tokenizer trained on a few sentences, so they exercise exactly the code paths a real
Llama/Mistral/Qwen2/GPT-2 checkpoint does.

    python -m swarm.train.hf.tiny /tmp/tiny-llama --arch llama
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ARCHS = ("llama", "mistral", "qwen2", "gpt2")
SAMPLE_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A pipeline splits a transformer into blocks of layers, one block per peer.",
    "Question: what is two plus two? Answer: four.",
    "Volunteers lend their gaming PCs to fine-tune language models together.",
    "Low-rank adapters train a small number of parameters on top of a frozen base.",
]


def make_tiny_tokenizer(out_dir: str | Path, *, vocab_size: int = 320, texts: list[str] | None = None):
    """A byte-level BPE tokenizer (every string encodable) with ``<|endoftext|>`` as bos/eos/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((texts or SAMPLE_TEXT) * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(str(out_dir))
    return fast


def tiny_config(arch: str, vocab_size: int, special_id: int, *, n_layers: int = 4, hidden: int = 64):
    """The ``transformers`` config of a tiny model; Qwen2 and GPT-2 tie their embeddings like the real ones."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    # a wider init than the default 0.02: with hidden size 64 the frozen random head could otherwise not
    # express a confident prediction, and fine-tuning tests would have nothing to learn towards
    ids = {"bos_token_id": special_id, "eos_token_id": special_id, "pad_token_id": special_id, "initializer_range": 0.1}
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        vocab_size=vocab_size,
        max_position_embeddings=128,
        **ids,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "mistral":  # a short window so that tests exercise the sliding-window mask
        return MistralConfig(**common, sliding_window=8, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "gpt2":
        return GPT2Config(
            n_embd=hidden,
            n_layer=n_layers,
            n_head=4,
            n_positions=128,
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            **ids,
        )
    raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")


def make_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    n_layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """Write a random ``arch`` model and its tokenizer to ``out_dir``; ``max_shard_size`` (e.g. "40KB") shards it."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(out)
    config = tiny_config(arch, len(tokenizer), tokenizer.eos_token_id, n_layers=n_layers, hidden=hidden)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)  # safetensors is the default format
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args(argv)
    print(make_tiny_checkpoint(args.out_dir, args.arch, n_layers=args.layers, hidden=args.hidden))


if __name__ == "__main__":
    main()
