"""What differs between the supported Hugging Face architectures, in one place.

``HFStageModel`` is written once against this small interface: tensor names of the embeddings, the
layers, the final norm and the head; how to construct one decoder layer with the ``transformers``
class the checkpoint was trained with; and how to call it (Llama-family layers need rotary embeddings
and position ids, GPT-2 blocks only a mask). Adding an architecture means adding one class here.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

# model_type -> class-name prefix in transformers.models.<type>.modeling_<type>
LLAMA_FAMILY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
SUPPORTED = (*LLAMA_FAMILY, "gpt2")
DROPOUT_KEYS = (
    "attention_dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "hidden_dropout",
    "summary_first_dropout",
)


def _base_prefix(names: set[str], candidates: tuple[str, ...], probe: str) -> str:
    """Checkpoints differ on whether the decoder sits under ``model.``/``transformer.`` (saved from the LM class)."""
    for prefix in candidates:
        if prefix + probe in names:
            return prefix
    raise KeyError(f"no tensor named {' or '.join(c + probe for c in candidates)} in the checkpoint")


def disable_dropout(config) -> None:
    """The base is frozen and every stage must compute what the reference model computes, so no dropout."""
    for key in DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


class Architecture:
    """Names and constructors for one checkpoint; subclasses fill in the family specifics."""

    lora_targets: tuple[str, ...] = ()
    fan_in_fan_out = False  # peft's flag for weights stored (in, out), i.e. GPT-2's Conv1D

    def __init__(self, config, names: set[str]) -> None:
        self.config = config
        self.n_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.context: int = int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0))
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_key = ""
        self.pos_embed_key: str | None = None
        self.layer_prefix = ""
        self.norm_prefix = ""
        self.head_key = "lm_head.weight"

    def layer_tensor_prefix(self, index: int) -> str:
        return f"{self.layer_prefix}{index}."

    def new_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def new_final_norm(self) -> nn.Module:
        raise NotImplementedError

    def new_rotary(self, device: torch.device) -> nn.Module | None:
        return None

    def masks(self, hidden: torch.Tensor, position_ids: torch.Tensor, layers: list[int]) -> dict[int, object]:
        """The attention mask each of ``layers`` needs (``None`` lets SDPA use its causal kernel)."""
        from transformers.masking_utils import create_causal_mask

        mask = create_causal_mask(self.config, hidden, None, None, position_ids=position_ids)
        return dict.fromkeys(layers, mask)

    def run_layer(
        self, layer: nn.Module, hidden: torch.Tensor, mask: object, position_ids: torch.Tensor, rope: object
    ) -> torch.Tensor:
        raise NotImplementedError


class LlamaFamily(Architecture):
    """Llama, Mistral and Qwen2: RMSNorm, rotary embeddings, grouped-query attention, gated MLP."""

    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, config, names: set[str]) -> None:
        super().__init__(config, names)
        prefix = LLAMA_FAMILY[config.model_type]
        module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        self._layer_cls = getattr(module, f"{prefix}DecoderLayer")
        self._norm_cls = getattr(module, f"{prefix}RMSNorm")
        self._rotary_cls = getattr(module, f"{prefix}RotaryEmbedding")
        base = _base_prefix(names, ("model.", ""), "embed_tokens.weight")
        self.embed_key = f"{base}embed_tokens.weight"
        self.layer_prefix = f"{base}layers."
        self.norm_prefix = f"{base}norm."
        self.head_key = self.embed_key if self.tied else "lm_head.weight"

    def new_layer(self, index: int) -> nn.Module:
        return self._layer_cls(self.config, index)

    def new_final_norm(self) -> nn.Module:
        return self._norm_cls(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def new_rotary(self, device: torch.device) -> nn.Module:
        return self._rotary_cls(config=self.config).to(device)

    def _kind(self, index: int) -> str:
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            return layer_types[index]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def masks(self, hidden: torch.Tensor, position_ids: torch.Tensor, layers: list[int]) -> dict[int, object]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        by_kind: dict[str, object] = {}
        out = {}
        for i in layers:
            kind = self._kind(i)
            if kind not in makers:
                raise NotImplementedError(f"layer {i} has attention type {kind!r}, which is not supported")
            if kind not in by_kind:
                by_kind[kind] = makers[kind](self.config, hidden, None, None, position_ids=position_ids)
            out[i] = by_kind[kind]
        return out

    def run_layer(
        self, layer: nn.Module, hidden: torch.Tensor, mask: object, position_ids: torch.Tensor, rope: object
    ) -> torch.Tensor:
        out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
        return out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returned a tuple


class GPT2Family(Architecture):
    """GPT-2: LayerNorm, learned position embeddings, fused ``c_attn``, ``Conv1D`` weights stored (in, out)."""

    lora_targets = ("c_attn", "c_proj", "c_fc")
    fan_in_fan_out = True

    def __init__(self, config, names: set[str]) -> None:
        super().__init__(config, names)
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        self._layer_cls = GPT2Block
        base = _base_prefix(names, ("transformer.", ""), "wte.weight")
        self.embed_key = f"{base}wte.weight"
        self.pos_embed_key = f"{base}wpe.weight"
        self.layer_prefix = f"{base}h."
        self.norm_prefix = f"{base}ln_f."
        self.head_key = self.embed_key if self.tied else "lm_head.weight"
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError(
                "GPT-2 with cross-attention is an encoder-decoder; only decoder-only is supported"
            )

    def new_layer(self, index: int) -> nn.Module:
        return self._layer_cls(self.config, layer_idx=index)

    def new_final_norm(self) -> nn.Module:
        return nn.LayerNorm(self.config.hidden_size, eps=self.config.layer_norm_epsilon)

    def run_layer(
        self, layer: nn.Module, hidden: torch.Tensor, mask: object, position_ids: torch.Tensor, rope: object
    ) -> torch.Tensor:
        out = layer(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


def architecture_class(model_type: str) -> type[Architecture]:
    """The family handler for a ``model_type``; a clear error for anything else."""
    if model_type in LLAMA_FAMILY:
        return LlamaFamily
    if model_type == "gpt2":
        return GPT2Family
    raise NotImplementedError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")


def architecture_for(config, names: set[str]) -> Architecture:
    """The handler for one checkpoint (its config and tensor names), with dropout switched off."""
    cls = architecture_class(config.model_type)
    disable_dropout(config)
    return cls(config, names)
