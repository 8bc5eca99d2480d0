"""Read a Hugging Face checkpoint directory one tensor at a time, by name, without loading the rest.

A peer that serves layers ``[a, b)`` of a 7B model must not need 14 GB of RAM to start, so nothing here
builds the whole model: the header of every ``*.safetensors`` shard (or ``model.safetensors.index.json``)
maps tensor names to files, and ``safe_open`` memory-maps a shard and copies out only the tensors asked
for. Everything is read from a local directory; nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from swarm.train.hf.checkpoint_check import INDEX_FILE, CheckpointError, load_config, weight_files

__all__ = ["INDEX_FILE", "CheckpointError", "CheckpointReader", "load_hf_config"]


def load_hf_config(path: str | Path, *, attn_implementation: str = "sdpa"):  # -> transformers.PretrainedConfig
    """The checkpoint's ``config.json``, with the attention kernel chosen explicitly.

    Decoder layers built outside a ``PreTrainedModel`` never get an attention implementation assigned,
    and with none the mask helpers silently return no causal mask; so it is always set here. A missing or
    unusable ``config.json`` is a ``CheckpointError`` naming it.
    """
    config = load_config(path)
    config._attn_implementation = attn_implementation
    return config


class CheckpointReader:
    """Name → shard map of a local safetensors checkpoint, reading tensors individually on demand.

    Everything wrong with the files (no shards, a shard the index names missing or corrupt, a tensor
    missing) is a ``CheckpointError`` naming the file: a peer's local copy may differ from the one the
    coordinator checked.
    """

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path).expanduser()
        self.files = weight_files(self.root)  # the index, or every shard's header
        self.read_names: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return sorted(self.files)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors in their stored dtype on the CPU, each shard opened once."""
        wanted = list(names)
        missing = [n for n in wanted if n not in self.files]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.root} lacks tensor {missing[0]}{more}")
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard, shard_names in by_file.items():
            try:
                with safe_open(str(shard), framework="pt", device="cpu") as f:
                    held = set(f.keys())
                    for name in shard_names:
                        if name not in held:
                            raise CheckpointError(f"{shard} has no tensor {name}, which {INDEX_FILE} says it holds")
                        out[name] = f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{shard} is truncated or corrupt ({e})") from None
        self.read_names.extend(wanted)
        return out
