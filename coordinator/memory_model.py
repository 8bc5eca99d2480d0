"""What a block of a Hugging Face checkpoint costs a peer in memory and FLOPs, from ``config.json`` alone.

The runtime planner (``plan_inputs.model_spec``) and ``ravn plan`` must agree on whether a block fits a
peer, so the arithmetic lives here once, pure (no torch, no weights read). It mirrors what
``swarm/train/hf/stage.py`` and ``swarm/train/stage_runner.py`` really hold:

* **base weights**, frozen, in ``dtype`` (``quant="none"``), int8 (1 byte + an fp32 scale per output
  row, ``quant.Int8Linear``) or NF4 (rows padded to 64, 32 bytes + an fp32 absmax per 64 values,
  ``nf4.NF4Linear``); norms and biases stay in ``dtype``. The first block holds the embedding, the last
  the final norm and the head (the embedding matrix again when tied, shared when one block has both).
* **adapters**: LoRA ``A`` (r x in) and ``B`` (out x r) in fp32 with their gradient and two AdamW
  moments, 16 bytes per parameter.
* **activations** per micro-batch in flight: the tensors autograd saves for the backward, derived from
  the code and checked against ``saved_tensors_hooks`` in ``tests/test_memory_model.py``. A frozen base
  linear saves only its weight (already counted), not its input; what is saved is each norm's fp32
  upcast of its input and its rsqrt, the SDPA kernel's q, k, v (not repeated for GQA), output and fp32
  logsumexp (flash-style kernels on CPU and CUDA; no T x T matrix), rotary cos/sin, the gated MLP's three
  (N x I) tensors (GPT-2's tanh GELU saves four), and each adapter's fp32 copy of its input (one per
  adapter in bf16/fp16, shared in fp32) plus its rank-r middle. With activation checkpointing only the
  layer input survives per micro-batch, and one layer's full set is rebuilt at a time.
* per block: the fp32 input received and the fp32 output kept for the gradient, per micro-batch in
  flight. The last block runs forward, loss and backward back to back, so it keeps one micro-batch's
  activations, plus its logits (in ``dtype``), log-softmax output and the two fp32 gradients of the loss.

FLOPs of one layer per micro-batch: forward ``2 N`` per base weight plus causal attention; backward one
more pass for input gradients only (the base has no weight gradients), the adapters and attention
twice; activation checkpointing adds a forward.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

GiB = 1 << 30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
LLAMA_TYPES = ("llama", "mistral", "qwen2")
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
NF4_BLOCK = 64
LOGIT_BYTES_FP32 = 12  # log-softmax output, its gradient and the logits' gradient, all fp32


class Linear(NamedTuple):
    """One projection; ``source`` names the tensor it reads, so adapters on the same input can share it."""

    name: str
    fan_in: int
    fan_out: int
    bias: bool
    source: str


@dataclass(frozen=True)
class Arch:
    """The sizes of a decoder-only checkpoint that memory and compute depend on."""

    model_type: str
    n_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_positions: int
    qkv_bias: bool = False

    @property
    def gpt2(self) -> bool:
        return self.model_type == "gpt2"

    @classmethod
    def from_config(cls, config: dict | object) -> Arch:
        """From a ``config.json`` dict or a ``transformers`` config; an unknown family is a clear error."""
        c = config if isinstance(config, dict) else config.to_dict()
        kind = c.get("model_type", "")
        if kind == "gpt2":
            d, heads = c["n_embd"], c["n_head"]
            return cls(
                model_type=kind,
                n_layers=c["n_layer"],
                hidden=d,
                intermediate=c.get("n_inner") or 4 * d,
                heads=heads,
                kv_heads=heads,
                head_dim=d // heads,
                vocab=c["vocab_size"],
                tied=bool(c.get("tie_word_embeddings", True)),
                max_positions=c.get("n_positions", 1024),
                qkv_bias=True,
            )
        if kind not in LLAMA_TYPES:
            raise ValueError(f"model_type {kind!r} is not supported; supported: {', '.join((*LLAMA_TYPES, 'gpt2'))}")
        d, heads = c["hidden_size"], c["num_attention_heads"]
        return cls(
            model_type=kind,
            n_layers=c["num_hidden_layers"],
            hidden=d,
            intermediate=c["intermediate_size"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or d // heads,
            vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
            max_positions=c.get("max_position_embeddings", 0),
            qkv_bias=kind == "qwen2" or bool(c.get("attention_bias", False)),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Arch:
        """A ``config.json`` file, or a checkpoint directory holding one; no weights are read."""
        p = Path(path).expanduser()
        p = p / "config.json" if p.is_dir() else p
        try:
            return cls.from_config(json.loads(p.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read a model config from {p}: {exc}") from None

    def linears(self) -> list[Linear]:
        """Each projection of one layer, in forward order."""
        d, inter, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.gpt2:
            return [
                Linear("c_attn", d, 3 * d, True, "norm1"),
                Linear("c_proj", d, d, True, "attention"),
                Linear("c_fc", d, inter, True, "norm2"),
                Linear("c_proj", inter, d, True, "mlp"),
            ]
        b = self.qkv_bias
        return [
            Linear("q_proj", d, q, b, "norm1"),
            Linear("k_proj", d, kv, b, "norm1"),
            Linear("v_proj", d, kv, b, "norm1"),
            Linear("o_proj", q, d, False, "attention"),
            Linear("gate_proj", d, inter, False, "norm2"),
            Linear("up_proj", d, inter, False, "norm2"),
            Linear("down_proj", inter, d, False, "mlp"),
        ]

    def default_targets(self) -> tuple[str, ...]:
        return GPT2_TARGETS if self.gpt2 else LLAMA_TARGETS


@dataclass(frozen=True)
class Settings:
    """The run's choices that change memory and compute (defaults are the runtime's)."""

    dtype: str = "bf16"
    quant: str = "none"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ()
    micro_batch_size: int = 4
    context: int = 512
    in_flight: int = 4
    activation_checkpointing: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.context

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class BlockMemory:
    """Bytes a peer holding one block needs, by kind (``total`` is what placement compares)."""

    base: float
    adapters: float
    activations: float
    ends: float  # weights of the embedding (first block), the final norm and head (last block)

    @property
    def total(self) -> float:
        return self.base + self.adapters + self.activations + self.ends


def matrix_bytes(rows: int, cols: int, quant: str, elem: int) -> float:
    """A frozen ``(rows, cols)`` weight as stored: in ``dtype``, int8 + fp32 row scales, or NF4 blocks."""
    if quant == "int8":
        return rows * cols + 4 * rows
    if quant == "nf4":
        blocks = math.ceil(cols / NF4_BLOCK)
        return rows * blocks * (NF4_BLOCK // 2 + 4)
    return rows * cols * elem


def layer_base_bytes(arch: Arch, s: Settings) -> float:
    """One decoder layer's frozen weights, norms and biases."""
    e = s.elem
    total = sum(matrix_bytes(m.fan_out, m.fan_in, s.quant, e) + m.bias * m.fan_out * e for m in arch.linears())
    norms = 4 * arch.hidden if arch.gpt2 else 2 * arch.hidden  # LayerNorm has a bias too
    return total + norms * s.elem


def _targets(arch: Arch, s: Settings) -> list[Linear]:
    names = s.lora_targets or arch.default_targets()
    return [m for m in arch.linears() if m.name in names] if s.lora_rank > 0 else []


def layer_adapter_bytes(arch: Arch, s: Settings) -> float:
    """LoRA parameters in fp32 with gradient and two AdamW moments: 16 bytes each."""
    return 16.0 * s.lora_rank * sum(m.fan_in + m.fan_out for m in _targets(arch, s))


def layer_activation_bytes(arch: Arch, s: Settings) -> float:
    """Bytes autograd saves in one layer's forward for one micro-batch of ``s.tokens`` tokens."""
    n, t = s.tokens, s.context
    e, d, inter = s.elem, arch.hidden, arch.intermediate
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    targets = _targets(arch, s)
    if arch.gpt2:
        norms = 2 * n * d * e + 4 * n * e  # LayerNorm: input, mean and rstd, in dtype
        attn = n * (3 * d) * e + n * d * e + n * arch.heads * 4  # c_attn output (q,k,v views), out, logsumexp
        mlp = 4 * n * inter * e  # tanh GELU's saved intermediates
    else:
        norms = 2 * (n * d * 4 + n * 4)  # RMSNorm: fp32 upcast of its input, rsqrt
        attn = n * q * e + 2 * n * kv * e + n * q * e + n * arch.heads * 4 + 2 * t * arch.head_dim * e
        mlp = 3 * n * inter * e  # silu(gate) input, its output and up
    adapters = sum(n * s.lora_rank * 4 for _ in targets)  # each B's input, fp32
    if s.dtype == "fp32":  # .to(fp32) is a no-op: adapters on one input share it; SDPA already saved its output
        adapters += sum(n * 4 * w for src, w in {m.source: m.fan_in for m in targets}.items() if src != "attention")
    else:  # every adapter upcasts its own fp32 copy of its input
        adapters += sum(n * 4 * m.fan_in for m in targets)
    return float(norms + attn + mlp + adapters)


def in_flight_layer_bytes(arch: Arch, s: Settings) -> float:
    """What one layer keeps for all micro-batches in flight (only its input with checkpointing)."""
    if s.activation_checkpointing:
        return float(s.in_flight * s.tokens * arch.hidden * s.elem)
    return s.in_flight * layer_activation_bytes(arch, s)


def embedding_bytes(arch: Arch, s: Settings) -> float:
    """The first block's token (and GPT-2 position, always in dtype) embeddings."""
    table = matrix_bytes(arch.vocab, arch.hidden, s.quant, s.elem)
    return table + (arch.max_positions * arch.hidden * s.elem if arch.gpt2 else 0)


def head_bytes(arch: Arch, s: Settings, *, holds_embedding: bool = False) -> float:
    """The last block's final norm and head; a tied head held with the embedding costs nothing more."""
    norm = (2 if arch.gpt2 else 1) * arch.hidden * s.elem
    if arch.tied and holds_embedding:
        return norm
    return norm + matrix_bytes(arch.vocab, arch.hidden, s.quant, s.elem)


def logits_bytes(arch: Arch, s: Settings) -> float:
    """One micro-batch's logits in dtype plus the fp32 log-softmax output and gradients of the loss."""
    return float(s.tokens * arch.vocab * (s.elem + LOGIT_BYTES_FP32))


def dequantized_bytes(arch: Arch, s: Settings, *, last: bool = False) -> float:
    """The one weight an int8/NF4 matmul dequantises to ``dtype`` at a time (the block's largest; on the last
    block that is the head). Nothing for a base stored in ``dtype``."""
    if s.quant == "none":
        return 0.0
    largest = max(lin.fan_in * lin.fan_out for lin in arch.linears())
    return float(max(largest, arch.vocab * arch.hidden if last else 0) * s.elem)


def stage_overhead_bytes(arch: Arch, s: Settings) -> float:
    """Per block, whatever its size: the fp32 input and output per micro-batch in flight, one dequantised
    weight of a quantised base, and with checkpointing one layer's rebuilt activations."""
    buffers = 2 * s.in_flight * s.tokens * arch.hidden * 4 + dequantized_bytes(arch, s)
    return buffers + (layer_activation_bytes(arch, s) if s.activation_checkpointing else 0)


def block_memory(arch: Arch, s: Settings, start: int, end: int) -> BlockMemory:
    """The prediction for a peer holding layers ``[start, end)``: what a benchmark compares to reality.

    A block keeps the activations of ``s.in_flight`` micro-batches, except the last, which keeps one:
    ``StageRunner`` runs its forward, loss and backward back to back.
    """
    if not 0 <= start < end <= arch.n_layers:
        raise ValueError(f"invalid block [{start}, {end}) for a model of {arch.n_layers} layers")
    k = end - start
    first, last = start == 0, end == arch.n_layers
    s = replace(s, in_flight=1) if last else s
    ends = (embedding_bytes(arch, s) if first else 0.0) + (head_bytes(arch, s, holds_embedding=first) if last else 0.0)
    activations = k * in_flight_layer_bytes(arch, s) + stage_overhead_bytes(arch, s)
    if last:  # the head, dequantised whole, may outweigh the largest layer weight counted in the overhead
        activations += logits_bytes(arch, s) + dequantized_bytes(arch, s, last=True) - dequantized_bytes(arch, s)
    return BlockMemory(k * layer_base_bytes(arch, s), k * layer_adapter_bytes(arch, s), activations, ends)


def layer_memory(arch: Arch, s: Settings) -> tuple[float, ...]:
    """Per-layer bytes for ``ModelSpec`` (additive over a block): the embedding on layer 0, the head and the
    logits on the last layer. ``stage_overhead_bytes`` is per block, so callers take it off each peer's memory."""
    per = layer_base_bytes(arch, s) + layer_adapter_bytes(arch, s) + in_flight_layer_bytes(arch, s)
    out = [per] * arch.n_layers
    out[0] += embedding_bytes(arch, s)
    out[-1] += head_bytes(arch, s, holds_embedding=arch.n_layers == 1) + logits_bytes(arch, s)
    out[-1] += dequantized_bytes(arch, s, last=True) - dequantized_bytes(arch, s)
    return tuple(out)


def last_layer_memory(arch: Arch, s: Settings) -> tuple[float, ...]:
    """``layer_memory`` for layers in the last block, which keeps one micro-batch's activations at a time."""
    return layer_memory(arch, replace(s, in_flight=1))


def layer_flops(arch: Arch, s: Settings) -> float:
    """FLOPs of one decoder layer for one micro-batch, forward and backward (and recompute)."""
    n, t = s.tokens, s.context
    base = 2.0 * n * sum(m.fan_in * m.fan_out for m in arch.linears())
    lora = 2.0 * n * s.lora_rank * sum(m.fan_in + m.fan_out for m in _targets(arch, s))
    attn = 2.0 * n * t * arch.heads * arch.head_dim  # QK^T and PV, causal half of 2 x 2 N T h d
    forward = base + lora + attn
    backward = base + 2 * lora + 2 * attn  # input gradients only for the frozen base
    return forward + backward + (forward if s.activation_checkpointing else 0.0)


def head_flops(arch: Arch, s: Settings) -> float:
    """The last block's head: forward and the input gradient (2 N d V each)."""
    return 4.0 * s.tokens * arch.hidden * arch.vocab


def layer_costs(arch: Arch, s: Settings) -> tuple[float, ...]:
    """Per-layer cost in units of one decoder layer (what peers measure): 1 each, the head on the last."""
    out = [1.0] * arch.n_layers
    out[-1] += head_flops(arch, s) / layer_flops(arch, s)
    return tuple(out)


def min_memory_for(arch: Arch, s: Settings, layers: int) -> float:
    """The most a peer needs among blocks of ``layers`` layers (the worst is the first or the last)."""
    layers = max(1, min(layers, arch.n_layers))
    return max(
        block_memory(arch, s, 0, layers).total, block_memory(arch, s, arch.n_layers - layers, arch.n_layers).total
    )
