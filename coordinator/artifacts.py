"""What a run leaves behind under ``runs/<name>/``: metrics, a loss curve, the merged checkpoint."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from swarm.config import HFConfig, ModelConfig, TrainConfig
from swarm.train.checkpoint import save_checkpoint


class RunArtifacts:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        self._metrics = path.open("a", buffering=1)
        if torn:  # a coordinator killed mid-line: the resumed run's lines must not stick to that fragment
            self._metrics.write("\n")

    def log(self, kind: str, **values: object) -> None:
        self._metrics.write(json.dumps({"kind": kind, "time": time.time(), **values}) + "\n")

    def write_config(self, model: ModelConfig, train: TrainConfig, extra: dict) -> None:
        data = {"model": asdict(model), "train": asdict(train), **extra}
        (self.dir / "config.json").write_text(json.dumps(data, indent=2))

    def write_checkpoint(self, state: dict[str, torch.Tensor], model: ModelConfig, meta: dict[str, str]) -> Path:
        return save_checkpoint(self.dir / "model.safetensors", state, model, meta)

    def write_adapter(self, state: dict[str, torch.Tensor], hf: HFConfig) -> Path:
        """Adapters only, in peft's format; reads the checkpoint's config.json, never its weights."""
        from swarm.train.hf import adapter_settings
        from swarm.train.hf.lora import save_peft_adapter

        settings = adapter_settings(hf.path, rank=hf.lora_rank, alpha=hf.lora_alpha, targets=hf.lora_targets or None)
        return save_peft_adapter(state, self.dir / "adapter", **settings)

    def plot_losses(self, train: list[tuple[int, float]], val: list[tuple[int, float]]) -> Path | None:
        if not train:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([s for s, _ in train], [v for _, v in train], label="train", lw=1)
        if val:
            ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.dir / "loss.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def close(self) -> None:
        self._metrics.close()
