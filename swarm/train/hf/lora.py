"""LoRA adapters on a block's frozen projections, saved in the format ``peft`` loads.

Our own ~100 lines instead of ``peft.inject_adapter_in_model``, because the frozen base here is often
our ``Int8Linear`` or ``NF4Linear``, which peft does not know (its int8 and 4-bit paths need
bitsandbytes), and because adapter names and initialisation must depend only on the global layer
index and a seed, so every peer builds exactly the adapters the unsplit model would. The math is
peft's: ``y = base(x) + B(A(x)) * alpha / r`` with ``A`` Kaiming-uniform and ``B`` zero (the output
equals the base at init);
adapters are kept in fp32 for the optimizer. ``save_peft_adapter`` writes ``adapter_config.json`` +
``adapter_model.safetensors`` under peft's names, so ``PeftModel.from_pretrained`` loads the result on
the full model; the tests check that round trip.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from swarm.train.hf.quant import QUANTIZED_LINEARS

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of ``nn.Linear``, ``Int8Linear``, ``NF4Linear`` or GPT-2's ``Conv1D`` (stored (in, out)), else None."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, (nn.Linear, *QUANTIZED_LINEARS)):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little") >> 1)
    return g


class LoRALinear(nn.Module):
    """A frozen linear-like ``base`` plus a trainable low-rank update ``B @ A`` scaled by ``alpha / rank``."""

    def __init__(self, base: nn.Module, *, rank: int, alpha: float, name: str, seed: int = 0) -> None:
        super().__init__()
        features = linear_features(base)
        if features is None or rank <= 0:
            raise ValueError(f"cannot put a rank-{rank} adapter on {type(base).__name__}")
        in_f, out_f = features
        device = next(iter(base.state_dict().values())).device
        self.base = base
        self.lora_A = nn.Linear(in_f, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, out_f, bias=False, device=device, dtype=torch.float32)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        with torch.no_grad():
            a = torch.empty(rank, in_f)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=_generator(seed, name))
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        delta = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling
        # summed in fp32 and rounded once, as peft does: rounding the delta to bf16 before the sum made a
        # bf16 run drift from peft's by ~1e-3 in loss within 5 steps (benchmarks/peft_reference.py)
        return (y + delta).to(y.dtype)


def attach_lora(
    layer: nn.Module, *, targets: Sequence[str], rank: int, alpha: float, name_prefix: str, seed: int = 0
) -> list[str]:
    """Wrap every linear-like submodule whose last name part is in ``targets`` (peft's matching rule)."""
    wrapped = []
    for name, child in list(layer.named_modules()):
        if name and name.rsplit(".", 1)[-1] in targets and linear_features(child) is not None:
            layer.set_submodule(name, LoRALinear(child, rank=rank, alpha=alpha, name=name_prefix + name, seed=seed))
            wrapped.append(name)
    if not wrapped:
        raise ValueError(f"no module named any of {list(targets)} in {name_prefix.rstrip('.')}")
    return wrapped


def save_peft_adapter(
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    *,
    rank: int,
    alpha: float,
    targets: Iterable[str],
    fan_in_fan_out: bool = False,
    layers: Iterable[int] | None = None,
    base_model: str | None = None,
) -> Path:
    """Write adapters (keys like ``model.layers.3.self_attn.q_proj.lora_A.weight``) as a peft LoRA directory.

    The coordinator calls this on the union of every stage's ``trainable_state_dict()``; ``layers``
    restricts peft to the layers present when only some blocks are saved.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {PEFT_PREFIX + k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sorted(tensors.items())}
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(set(targets)),
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "layers_to_transform": sorted(set(layers)) if layers is not None else None,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_peft_adapter(
    adapter_dir: str | Path, *, prefixes: Sequence[str] = ("",)
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter config, tensors under our names) from a peft LoRA directory; only keys under ``prefixes``."""
    root = Path(adapter_dir)
    config = json.loads((root / ADAPTER_CONFIG).read_text())
    tensors = {}
    with safe_open(str(root / ADAPTER_WEIGHTS), framework="pt", device="cpu") as f:
        for key in f.keys():
            name = key.removeprefix(PEFT_PREFIX).replace(".default.", ".")
            if any(name.startswith(p) for p in prefixes):
                tensors[name] = f.get_tensor(key)
    return config, tensors
