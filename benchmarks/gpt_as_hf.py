"""A Ravn-trained built-in GPT as a Hugging Face GPT-2 checkpoint, for fine-tuning experiments offline.

Fine-tuning is where a sample returns with its activations barely moved (LoRA over a frozen base), the
case activation deltas are for. No pretrained checkpoint can be downloaded here, so a benchmark trains
gpt-medium with ``ravn local`` and fine-tunes the result through the Hugging Face path. The built-in GPT
is GPT-2's block exactly (pre-norm, fused qkv, exact GELU, learned positions); only the layout differs:
GPT-2's ``Conv1D`` stores weights transposed, and its tokenizer adds ``<|endoftext|>``, so the
vocabulary is the 256 bytes (id = byte value) plus that token at 256, whose embedding and head rows
are zero.

    python -m benchmarks.gpt_as_hf runs/NAME/model.safetensors OUT_DIR --model gpt-medium
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from swarm.config import MODEL_PRESETS, ModelConfig

EOS = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chars from 256 up."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in kept else next(extra)) for b in range(256)}


def byte_tokenizer(out_dir: Path):
    """Token id = byte value, and ``<|endoftext|>`` = 256: the built-in corpus's ids, in GPT-2's format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()} | {EOS: 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(str(out_dir))
    return fast


def convert(weights: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path) -> Path:
    """Write ``weights`` (a built-in GPT's merged state dict) as a GPT-2 checkpoint with its tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_positions=cfg.context,
        vocab_size=cfg.vocab_size + 1,
        activation_function="gelu",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        bos_token_id=cfg.vocab_size,
        eos_token_id=cfg.vocab_size,
        pad_token_id=cfg.vocab_size,
    )
    model = GPT2LMHeadModel(config)
    pad = torch.zeros(1, cfg.d_model)
    state = {
        "transformer.wte.weight": torch.cat([weights["tok_emb.weight"], pad]),
        "transformer.wpe.weight": weights["pos_emb.weight"],
        "transformer.ln_f.weight": weights["ln_f.weight"],
        "transformer.ln_f.bias": weights["ln_f.bias"],
        "lm_head.weight": torch.cat([weights["head.weight"], pad]),
    }
    names = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj"}
    names |= {"mlp.0": "mlp.c_fc", "mlp.2": "mlp.c_proj"}
    for i in range(cfg.n_layers):
        for ours, theirs in names.items():
            w, b = weights[f"layers.{i}.{ours}.weight"], weights[f"layers.{i}.{ours}.bias"]
            conv1d = not ours.startswith("ln")  # GPT-2's Conv1D holds (in, out)
            state[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if conv1d else w
            state[f"transformer.h.{i}.{theirs}.bias"] = b
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith(".attn.bias") and "masked_bias" not in k for k in missing):
        raise ValueError(f"weights do not map onto GPT-2: missing {missing}, unexpected {unexpected}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    byte_tokenizer(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", type=Path, help="a run's model.safetensors")
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="gpt-medium", choices=sorted(MODEL_PRESETS))
    args = parser.parse_args()
    print(convert(load_file(str(args.weights)), MODEL_PRESETS[args.model], args.out))


if __name__ == "__main__":
    main()
