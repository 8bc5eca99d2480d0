"""Fine-tune Hugging Face checkpoints across the swarm: frozen (optionally int8 or NF4) base, LoRA adapters.

Needs the ``hf`` extra (``transformers``, ``tokenizers``, ``peft`` for loading saved adapters). Every
file is read from a local checkpoint directory; nothing is downloaded. See docs/finetune.md.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("swarm.train.hf needs transformers: pip install 'ravn-swarm[hf]'") from exc

from swarm.train.hf.data import TokenCorpus, load_tokenizer
from swarm.train.hf.lora import read_peft_adapter, save_peft_adapter
from swarm.train.hf.stage import HFStageModel, adapter_settings, hf_model_config

__all__ = [
    "HFStageModel",
    "TokenCorpus",
    "adapter_settings",
    "hf_model_config",
    "load_tokenizer",
    "read_peft_adapter",
    "save_peft_adapter",
]
