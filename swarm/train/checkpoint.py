"""Whole-model checkpoints in safetensors: the blocks' tensors merged under their global names."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from swarm.config import ModelConfig
from swarm.train.model import StageModel, full_model


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], model: ModelConfig, meta: dict[str, str]) -> Path:
    """Write atomically, refusing a state that does not cover the whole model exactly."""
    expected = set(full_model(model).state_dict())
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise ValueError(
            f"checkpoint does not match the model: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
        )
    tmp = path.with_suffix(".tmp")
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(tmp),
        metadata={"model_config": json.dumps(asdict(model)), **meta},
    )
    tmp.replace(path)
    return path


def state_digest(weights: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> str:
    """A fingerprint of a block's state (names, dtypes, shapes, bytes): a peer logs it when it restores,
    so that what it loaded can be checked against the checkpoint files on the coordinator's disk."""
    h = hashlib.sha256()
    for kind, part in (("w", weights), ("o", optim)):
        for name in sorted(part):
            t = part[name].detach().cpu().contiguous()
            h.update(f"{kind}/{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def load_checkpoint(path: Path | str) -> tuple[StageModel, ModelConfig]:
    """Rebuild the unsplit model from a run's checkpoint."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "model_config" not in meta:
        raise ValueError(f"{path} is not a Ravn checkpoint (no model_config metadata)")
    cfg = ModelConfig(**json.loads(meta["model_config"]))
    model = full_model(cfg)
    model.load_state_dict(load_file(str(path)))
    return model, cfg
