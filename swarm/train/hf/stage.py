"""One pipeline block ``[start, end)`` of a Hugging Face causal LM, with ``swarm.train.model.StageModel``'s interface.

The decoder layers are the ``transformers`` classes the checkpoint was trained with (so numerics match
``AutoModelForCausalLM``), but they are built on the meta device and filled only with this block's
tensors from the safetensors shards: a peer never materialises the whole model. The first block owns
the token (and, for GPT-2, position) embeddings; the last owns the final norm and the head, reading the
embedding matrix for it when the checkpoint ties them. The base is frozen (bf16/fp16/fp32, or int8 / NF4
weight-only); the only trainable parameters are LoRA adapters. With activation checkpointing each
decoder layer keeps only its input for the backward and recomputes the rest there.

Hidden states leave a non-last block as fp32 whatever the compute dtype, because that is what the
wire codecs and ``StageRunner`` exchange today; the cast is exact for bf16/fp16 and its backward is free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarm.config import ModelConfig
from swarm.train.hf.arch import Architecture, architecture_class, architecture_for
from swarm.train.hf.checkpoint_check import CheckpointError, positions
from swarm.train.hf.loader import CheckpointReader, load_hf_config
from swarm.train.hf.lora import attach_lora, read_peft_adapter, save_peft_adapter
from swarm.train.hf.quant import (
    QUANTIZED_EMBEDDINGS,
    quantize_linears,
    quantized_embedding,
    quantized_linear,
    tensor_bytes,
)

IGNORE_INDEX = -100
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


class HFStageModel(nn.Module):
    """Layers ``[start, end)`` of a local HF checkpoint; embeddings if first, final norm and head if last.

    ``lora_rank=0`` builds a frozen block (evaluation, or checking splits); ``lora_rank>0`` adds adapters
    on ``lora_targets`` (default: every attention and MLP projection of the architecture).
    """

    def __init__(
        self,
        path: str | Path,
        start: int,
        end: int,
        *,
        dtype: str | torch.dtype = torch.bfloat16,
        quant: str = "none",
        activation_checkpointing: bool = False,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        seed: int = 0,
        attn_implementation: str = "sdpa",
    ) -> None:
        super().__init__()
        self.path = Path(path).expanduser()
        self.hf_config = load_hf_config(self.path, attn_implementation=attn_implementation)
        self.reader = CheckpointReader(self.path)
        try:
            self.arch: Architecture = architecture_for(self.hf_config, set(self.reader.files))
        except KeyError as e:  # the embedding is under neither prefix
            raise CheckpointError(f"{self.path}: {e.args[0] if e.args else e}") from None
        n = self.arch.n_layers
        if not 0 <= start < end <= n:
            raise ValueError(f"invalid block [{start}, {end}) for a model of {n} layers")
        self.start, self.end, self.n_layers = start, end, n
        self.is_first, self.is_last = start == 0, end == n
        self.dtype, self.device = parse_dtype(dtype), torch.device(device)
        if quant not in ("none", "int8", "nf4"):
            raise ValueError(f"unknown base quantisation {quant!r}; choose none, int8 or nf4")
        self.quant, self.activation_checkpointing = quant, activation_checkpointing
        self.d_model, self.vocab_size, self.context = self.arch.hidden_size, self.arch.vocab_size, self.arch.context

        self.layers = nn.ModuleDict(
            {
                str(i): self._load(lambda i=i: self.arch.new_layer(i), self.arch.layer_tensor_prefix(i))
                for i in range(start, end)
            }
        )
        self.rotary = self.arch.new_rotary(self.device)
        if self.is_first:
            self.embed = self._load_embedding(self.arch.embed_key, quantize=quant != "none")
            if self.arch.pos_embed_key:  # small, and added to every token: kept in the compute dtype
                self.pos_embed = self._load_embedding(self.arch.pos_embed_key, quantize=False)
        if self.is_last:
            self.norm = self._load(self.arch.new_final_norm, self.arch.norm_prefix)
            self.head = self._load_head()
        self.requires_grad_(False)

        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self.lora_targets = tuple(lora_targets or self.arch.lora_targets)
        if lora_rank > 0:
            for i in range(start, end):
                attach_lora(
                    self.layers[str(i)],
                    targets=self.lora_targets,
                    rank=lora_rank,
                    alpha=lora_alpha,
                    name_prefix=self.arch.layer_tensor_prefix(i),
                    seed=seed,
                )
        self._check_materialised()

    # ---- building ---------------------------------------------------------------------------------

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return (t.to(self.dtype) if t.is_floating_point() else t).to(self.device)

    def _load(self, factory: Callable[[], nn.Module], prefix: str) -> nn.Module:
        """Build ``factory()`` on the meta device, then fill it with exactly its tensors from the checkpoint."""
        with torch.device("meta"):
            module = factory()
        expected = module.state_dict()  # meta tensors: names and shapes only
        keys = list(expected)

        def check(k: str, v: torch.Tensor) -> None:  # each tensor as it is read
            if tuple(v.shape) != tuple(expected[k].shape):
                raise CheckpointError(
                    f"{self.reader.files[prefix + k]}: tensor {prefix + k} has shape {list(v.shape)}, "
                    f"but config.json implies {list(expected[k].shape)}"
                )

        raw = self.reader.lazy({k: prefix + k for k in keys}, check=check)  # read one at a time, as converted
        quantized: list[str] = []
        if self.quant != "none":  # quantised from the stored (not down-cast) weights
            quantized = quantize_linears(module, quant=self.quant, dtype=self.dtype, device=self.device, raw=raw)
        # no name holds a stored tensor past its conversion, so the next read finds it gone (one in flight)
        converted = {k: self._cast(raw.pop(k)) for k in raw.keys()}
        missing, unexpected = module.load_state_dict(converted, strict=False, assign=True)
        missing = [k for k in missing if not any(k.startswith(q + ".") for q in quantized)]
        if missing or unexpected:
            raise CheckpointError(f"{self.path}: loading {prefix}: missing {missing}, unexpected {unexpected}")
        return module

    def _read_matrix(self, key: str, rows: int) -> torch.Tensor:
        """One (rows, hidden) matrix: an embedding or the head (CheckpointError naming its shard if it is not)."""
        weight = self.reader.read([key])[key]
        if tuple(weight.shape) != (rows, self.d_model):
            raise CheckpointError(
                f"{self.reader.files[key]}: tensor {key} has shape {list(weight.shape)}, "
                f"but config.json implies {[rows, self.d_model]}"
            )
        return weight

    def _load_embedding(self, key: str, *, quantize: bool) -> nn.Module:
        weight = self._read_matrix(key, self.context if key == self.arch.pos_embed_key else self.vocab_size)
        if quantize:
            return quantized_embedding(weight, quant=self.quant, dtype=self.dtype).to(self.device)
        return nn.Embedding.from_pretrained(self._cast(weight), freeze=True)

    def _load_head(self) -> nn.Module:
        key = self.arch.head_key
        if self.is_first and key == self.arch.embed_key:  # tied and this block has both ends: share storage
            return self.embed.as_linear() if isinstance(self.embed, QUANTIZED_EMBEDDINGS) else _TiedHead(self.embed)
        weight = self._read_matrix(key, self.vocab_size)
        if self.quant != "none":
            return quantized_linear(weight, None, quant=self.quant, dtype=self.dtype).to(self.device)
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(self._cast(weight), requires_grad=False)
        return head

    def _check_materialised(self) -> None:
        left = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"tensors not loaded from the checkpoint: {left[:5]}")

    # ---- the StageModel interface ---------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; fp32 hidden states, or logits on the last stage, out."""
        if self.is_first:
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2:
                raise ValueError(f"first stage expects (batch, time) token ids, got {x.dtype} {tuple(x.shape)}")
            h = self.embed(x)
        else:
            if not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != self.d_model:
                raise ValueError(
                    f"expected (batch, time, {self.d_model}) hidden states, got {x.dtype} {tuple(x.shape)}"
                )
            h = x.to(self.dtype)
        t = x.shape[1]
        if self.context and t > self.context:
            raise ValueError(f"sequence of {t} tokens exceeds the model's {self.context} positions")
        position_ids = torch.arange(t, device=h.device)[None, :]
        if self.is_first and hasattr(self, "pos_embed"):
            h = h + self.pos_embed(position_ids)
        indices = list(range(self.start, self.end))
        masks = self.arch.masks(h, position_ids, indices)
        rope = self.rotary(h, position_ids) if self.rotary is not None else None
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for i in indices:
            args = (self.layers[str(i)], h, masks[i], position_ids, rope)
            h = checkpoint(self.arch.run_layer, *args, use_reentrant=False) if recompute else self.arch.run_layer(*args)
        if self.is_last:
            return self.head(self.norm(h))
        return h.float()

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy over targets that are not -100 (masked prompt tokens and padding)."""
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def input_shape(self, batch: int, time: int) -> tuple[int, ...]:
        return (batch, time) if self.is_first else (batch, time, self.d_model)

    def model_config(self, context: int) -> ModelConfig:
        """A ``swarm.config.ModelConfig`` whose sizes let ``StageRunner`` validate this model's tensors."""
        return hf_model_config(self.path, context)

    # ---- adapters -------------------------------------------------------------------------------------

    def _hf_name(self, name: str) -> str:
        return self.arch.layer_prefix + name.removeprefix("layers.") if name.startswith("layers.") else name

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of this block's adapters under global HF names (``model.layers.7.mlp.up_proj.lora_A.weight``)."""
        return {
            self._hf_name(n): p.detach().to("cpu", copy=True) for n, p in self.named_parameters() if p.requires_grad
        }

    def load_trainable_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load this block's adapters from a dict keyed as ``trainable_state_dict`` (extra layers are ignored)."""
        params = {self._hf_name(n): p for n, p in self.named_parameters() if p.requires_grad}
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise KeyError(f"adapter tensors missing for this block: {missing[:5]}")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(tensors[name].shape) != tuple(p.shape):
                    raise ValueError(f"{name}: shape {tuple(tensors[name].shape)} != {tuple(p.shape)}")
                p.copy_(tensors[name])

    def load_adapter(self, adapter_dir: str | Path) -> None:
        """Resume from a peft LoRA directory (ours or peft's), reading only this block's layers."""
        config, tensors = read_peft_adapter(
            adapter_dir, prefixes=[self.arch.layer_tensor_prefix(i) for i in range(self.start, self.end)]
        )
        if int(config["r"]) != self.lora_rank:
            raise ValueError(f"adapter has rank {config['r']}, this block was built with rank {self.lora_rank}")
        self.load_trainable_state_dict(tensors)

    def adapter_settings(self) -> dict:
        """Keyword arguments of ``save_peft_adapter`` that describe these adapters (for merging blocks)."""
        return adapter_settings(self.path, rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets)

    def save_adapter(self, out_dir: str | Path) -> Path:
        """This block's adapters as a peft directory (restricted to its layers unless it holds them all)."""
        if self.lora_rank <= 0:
            raise ValueError("this block has no adapters (lora_rank=0)")
        whole = self.is_first and self.is_last
        layers = None if whole else range(self.start, self.end)
        return save_peft_adapter(self.trainable_state_dict(), out_dir, layers=layers, **self.adapter_settings())

    def weight_bytes(self) -> int:
        """Bytes of the frozen base held by this block (adapters excluded), counting shared storage once."""
        return tensor_bytes(self, exclude=("lora_A", "lora_B"))


class _TiedHead(nn.Module):
    """The output head of a tied checkpoint when one block holds both ends: reuses the embedding matrix."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embedding.weight)


def adapter_settings(
    path: str | Path, *, rank: int, alpha: float, targets: Sequence[str] | None = None
) -> dict[str, object]:
    """``save_peft_adapter`` keyword arguments for a run, from ``config.json`` alone (no weights are read).

    The coordinator merges every stage's ``trainable_state_dict()`` and saves them with these.
    """
    config = load_hf_config(path)
    family = architecture_class(config.model_type)
    return {
        "rank": rank,
        "alpha": alpha,
        "targets": tuple(targets or family.lora_targets),
        "fan_in_fan_out": family.fan_in_fan_out,
        "base_model": str(Path(path).expanduser()),
    }


def hf_model_config(path: str | Path, context: int) -> ModelConfig:
    """Sizes of a HF checkpoint as a ``ModelConfig`` (training sequence length ``context``) for StageRunner's checks."""
    config = load_hf_config(path)
    max_positions = positions(config) or context
    if context > max_positions:
        raise CheckpointError(
            f"context {context} exceeds the {max_positions} positions of {Path(path).expanduser() / 'config.json'} "
            f"(use --context {max_positions} or less)"
        )
    return ModelConfig(
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
        n_heads=config.num_attention_heads,
        vocab_size=config.vocab_size,
        context=context,
    )
