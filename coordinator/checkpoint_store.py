"""The coordinator's store of block checkpoints: what lets the swarm lose a peer but not its progress.

Every stage sends its trainable weights and optimizer state every C steps, all at the same weight
version. A version is *complete* when its blocks cover every layer; recovery restarts the swarm from the
latest complete version, so losing any one peer costs at most C steps. The files are safetensors on disk
(``runs/<name>/checkpoints/v<version>/layers-<a>-<b>.safetensors``), so the index survives a coordinator
restart, and nothing received from a peer is ever unpickled.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_FILE = re.compile(r"layers-(\d+)-(\d+)\.safetensors$")


class CheckpointStore:
    def __init__(self, root: Path, n_layers: int, keep: int = 2) -> None:
        self.root, self.n_layers, self.keep = root, n_layers, keep
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def save(
        self,
        version: int,
        layer_start: int,
        layer_end: int,
        weights: dict[str, torch.Tensor],
        optim: dict[str, torch.Tensor],
    ) -> Path:
        if not 0 <= layer_start < layer_end <= self.n_layers:
            raise ValueError(f"block [{layer_start}, {layer_end}) is outside the model's {self.n_layers} layers")
        folder = self._dir(version)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"w/{k}": v.contiguous() for k, v in weights.items()}
        tensors.update({f"o/{k}": v.contiguous() for k, v in optim.items()})
        path = folder / f"layers-{layer_start}-{layer_end}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"version": str(version)})
        tmp.replace(path)
        if self.latest_complete() == version:
            self._prune(version)
        return path

    def _blocks(self, version: int) -> list[tuple[int, int, Path]]:
        folder = self._dir(version)
        if not folder.is_dir():
            return []
        found = [(int(m[1]), int(m[2]), p) for p in folder.iterdir() if (m := _FILE.search(p.name))]
        return sorted(found)

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())

    def is_complete(self, version: int) -> bool:
        covered, end = self._blocks(version), 0
        for a, b, _ in covered:  # blocks of one version never overlap: they come from one plan
            if a > end:
                return False
            end = max(end, b)
        return end >= self.n_layers

    def latest_complete(self) -> int | None:
        done = [v for v in self.versions() if self.is_complete(v)]
        return done[-1] if done else None

    def fetch(self, version: int, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The requested parameters and their optimizer state at ``version``, from whichever blocks hold them."""
        wanted = set(names)
        weights: dict[str, torch.Tensor] = {}
        optim: dict[str, torch.Tensor] = {}
        for _, _, path in self._blocks(version):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    kind, _, name = key.partition("/")
                    base = name.split("::", 1)[0]
                    if base not in wanted:
                        continue
                    (weights if kind == "w" else optim)[name] = f.get_tensor(key)
        missing = wanted - set(weights)
        if missing:
            raise KeyError(f"checkpoint v{version} has no {sorted(missing)[:3]}")
        return weights, optim

    def _prune(self, complete: int) -> None:
        older = [v for v in self.versions() if v < complete]
        for v in older[: max(0, len(older) - (self.keep - 1))]:
            shutil.rmtree(self._dir(v), ignore_errors=True)

    def describe(self) -> dict:
        return {"latest_complete": self.latest_complete(), "versions": self.versions()}

    def write_index(self) -> None:
        (self.root / "index.json").write_text(json.dumps(self.describe()))
