"""Build a stage's runner from its assignment: the built-in GPT, or a block of a Hugging Face checkpoint.

The only place that knows both kinds of block, so the daemon and the runner stay model-agnostic.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from swarm.config import HFConfig, ModelConfig, TrainConfig
from swarm.train.stage_runner import StageRunner


class CheckpointMismatch(ValueError):
    """This peer's checkpoint is not the one the coordinator planned with."""


def config_sha256(path: str | Path) -> str:
    return hashlib.sha256((Path(path).expanduser() / "config.json").read_bytes()).hexdigest()


def build_runner(
    model_cfg: ModelConfig, train_cfg: TrainConfig, start: int, end: int, device: str, hf: HFConfig | None = None
) -> StageRunner:
    if hf is None:
        return StageRunner(model_cfg, train_cfg, start, end, device)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    if not (Path(hf.path).expanduser() / "config.json").is_file():
        raise CheckpointMismatch(f"no Hugging Face checkpoint at {hf.path} on this peer (pass --hf-path)")
    if hf.config_sha256 and config_sha256(hf.path) != hf.config_sha256:
        raise CheckpointMismatch(f"the checkpoint at {hf.path} differs from the coordinator's (config.json hash)")
    from swarm.train.hf import HFStageModel

    block = HFStageModel(
        hf.path,
        start,
        end,
        dtype=hf.dtype,
        quant=hf.quant,
        activation_checkpointing=hf.activation_checkpointing,
        lora_rank=hf.lora_rank,
        lora_alpha=hf.lora_alpha,
        lora_targets=list(hf.lora_targets) or None,
        device=device,
        seed=model_cfg.seed,
    )
    return StageRunner(model_cfg, train_cfg, start, end, device, model=block)
