"""Read a Hugging Face checkpoint directory one tensor at a time, by name, without loading the rest.

A peer that serves layers ``[a, b)`` of a 7B model must not need 14 GB of RAM to start, so nothing here
builds the whole model: the header of every ``*.safetensors`` shard (or ``model.safetensors.index.json``)
maps tensor names to files, and ``safe_open`` memory-maps a shard and copies out only the tensors asked
for. Everything is read from a local directory; nothing is ever downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(path: str | Path, *, attn_implementation: str = "sdpa"):  # -> transformers.PretrainedConfig
    """The checkpoint's ``config.json``, with the attention kernel chosen explicitly.

    Decoder layers built outside a ``PreTrainedModel`` never get an attention implementation assigned,
    and with none the mask helpers silently return no causal mask; so it is always set here.
    """
    from transformers import AutoConfig

    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json; expected a local Hugging Face checkpoint directory")
    config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    config._attn_implementation = attn_implementation
    return config


class CheckpointReader:
    """Name → shard map of a local safetensors checkpoint, reading tensors individually on demand."""

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path).expanduser()
        self.files = self._weight_map()
        self.read_names: list[str] = []

    def _weight_map(self) -> dict[str, Path]:
        index = self.root / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.root / fname for name, fname in weight_map.items()}
        shards = sorted(self.root.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors files in {self.root} (pickled .bin checkpoints are not read)")
        files: dict[str, Path] = {}
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:  # reads the header only
                for name in f.keys():
                    files[name] = shard
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return sorted(self.files)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors in their stored dtype on the CPU, each shard opened once."""
        wanted = list(names)
        missing = [n for n in wanted if n not in self.files]
        if missing:
            raise KeyError(f"{self.root} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard, shard_names in by_file.items():
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in shard_names:
                    out[name] = f.get_tensor(name)
        self.read_names.extend(wanted)
        return out
