"""A decoder-only GPT (pre-norm, causal attention) that can be built one contiguous block at a time.

Any peer must be able to build any block ``[start, end)`` alone, bit-identical to the same layers of
the whole model: every parameter group is initialised from its own seed derived from the model seed
and the layer index, never from a shared RNG stream. The first block owns the embeddings; the last
block owns the final norm, the head and the loss. Parameter names carry the global layer index, so
the blocks' state dicts merge into the unsplit model's without renaming.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swarm.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _seeded(seed: int, *parts: int) -> torch.Generator:
    """A generator whose stream depends only on (model seed, part ids): order-independent init."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + sum(p * 7919 ** (i + 1) for i, p in enumerate(parts))) % (2**63))
    return g


def _init_layer(layer: TransformerLayer, cfg: ModelConfig, index: int) -> None:
    g = _seeded(cfg.seed, 1, index)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif name.startswith("ln"):
                p.fill_(1.0)
            else:
                std = residual_std if name in ("attn.proj.weight", "mlp.2.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


class StageModel(nn.Module):
    """Layers ``[start, end)`` of the GPT, plus embeddings if first and head if last."""

    def __init__(self, cfg: ModelConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.n_layers:
            raise ValueError(f"invalid block [{start}, {end}) for a model of {cfg.n_layers} layers")
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.n_layers
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg) for i in range(start, end)})
        for i in range(start, end):
            _init_layer(self.layers[str(i)], cfg, i)
        if self.is_first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
            with torch.no_grad():
                self.tok_emb.weight.copy_(torch.randn(self.tok_emb.weight.shape, generator=_seeded(cfg.seed, 2)) * 0.02)
                self.pos_emb.weight.copy_(torch.randn(self.pos_emb.weight.shape, generator=_seeded(cfg.seed, 3)) * 0.02)
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=_seeded(cfg.seed, 4)) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits out."""
        if self.is_first:
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2:
                raise ValueError(f"first stage expects (batch, time) token ids, got {x.dtype} {tuple(x.shape)}")
            t = x.shape[1]
            if t > self.cfg.context:
                raise ValueError(f"sequence of {t} tokens exceeds the context of {self.cfg.context}")
            pos = torch.arange(t, device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for layer in self.layers.values():
            x = layer(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy; callers normalise by the step's token count."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")

    def input_shape(self, batch: int, time: int) -> tuple[int, ...]:
        return (batch, time) if self.is_first else (batch, time, self.cfg.d_model)


def full_model(cfg: ModelConfig) -> StageModel:
    """The unsplit model: the reference every pipeline split must reproduce."""
    return StageModel(cfg, 0, cfg.n_layers)


def even_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous blocks of (nearly) equal size; earlier stages get the extra layers."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
