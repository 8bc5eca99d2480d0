"""The coordinator's store of block checkpoints: what lets the swarm lose a peer but not its progress.

Every stage sends its trainable weights and optimizer state every C steps, all at the same weight
version. Recovery restarts the swarm from the latest complete version, so a failure costs the steps
since then.

A checkpoint belongs to one *plan epoch*: the timeline that starts when blocks are (re)assigned from a
restore point. After a recovery the survivors hold other blocks and replay steps the dead plan had
already taken, so the same version can arrive twice, cut differently; blocks of two epochs must never
be combined. Hence: every block is filed under its epoch; a version is complete only when the blocks of
one epoch cover every layer exactly once, and a restore reads that epoch's blocks only; starting an
epoch discards the versions newer than its restore point (a dead timeline's partial work); an upload
from any other epoch than the current one is refused and leaves the store as it was.

The files are safetensors on disk
(``runs/<name>/checkpoints/v<version>/e<epoch>/layers-<a>-<b>.safetensors``, the current epoch in
``epoch.json``), so the index survives a coordinator restart, and nothing received from a peer is ever
unpickled. Uploads arrive on worker threads; one lock orders them with recoveries.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_FILE = re.compile(r"^layers-(\d+)-(\d+)\.safetensors$")
_EPOCH_DIR = re.compile(r"^e(\d+)$")
EPOCH_FILE = "epoch.json"


class StaleCheckpoint(Exception):
    """An upload from a plan epoch that is not the run's current one: refused, nothing stored."""


def tiles(blocks: list[tuple[int, int]], n_layers: int) -> bool:
    """Do these blocks cover layers ``[0, n_layers)`` exactly once (no gap, no overlap)?"""
    end = 0
    for a, b in sorted(blocks):
        if a != end:
            return False
        end = b
    return end == n_layers


class CheckpointStore:
    def __init__(self, root: Path, n_layers: int, keep: int = 2) -> None:
        self.root, self.n_layers, self.keep = root, n_layers, keep
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.epoch = self._read_epoch()

    def _read_epoch(self) -> int:
        path = self.root / EPOCH_FILE
        if not path.exists():
            return 0
        try:
            epoch = json.loads(path.read_text())["epoch"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is unreadable ({e}); start the run over with --fresh") from None
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"{path}: epoch must be a non-negative integer; start the run over with --fresh")
        return epoch

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def begin_epoch(self, restore_version: int) -> int:
        """New blocks start from ``restore_version``: later versions belong to a dead timeline. Returns
        the new epoch, the one every upload must carry from now on."""
        with self._lock:
            for v in self._versions():
                if v > restore_version:
                    shutil.rmtree(self._dir(v), ignore_errors=True)
            self.epoch += 1
            tmp = self.root / f"{EPOCH_FILE}.tmp"
            tmp.write_text(json.dumps({"epoch": self.epoch}))
            tmp.replace(self.root / EPOCH_FILE)
            return self.epoch

    def save(
        self,
        epoch: int,
        version: int,
        layer_start: int,
        layer_end: int,
        weights: dict[str, torch.Tensor],
        optim: dict[str, torch.Tensor],
    ) -> Path:
        if not 0 <= layer_start < layer_end <= self.n_layers:
            raise ValueError(f"block [{layer_start}, {layer_end}) is outside the model's {self.n_layers} layers")
        if epoch != self.epoch:  # checked again below, under the lock; this only saves writing the file
            raise StaleCheckpoint(f"checkpoint of plan epoch {epoch}; the run is at epoch {self.epoch}")
        tensors = {f"w/{k}": v.contiguous() for k, v in weights.items()}
        tensors.update({f"o/{k}": v.contiguous() for k, v in optim.items()})
        fd, name = tempfile.mkstemp(dir=self.root, prefix=".incoming-", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        try:
            save_file(tensors, str(tmp), metadata={"version": str(version), "epoch": str(epoch)})
            with self._lock:
                if epoch != self.epoch:  # a recovery began while this block was being written
                    raise StaleCheckpoint(f"checkpoint of plan epoch {epoch}; the run is at epoch {self.epoch}")
                folder = self._dir(version) / f"e{epoch:06d}"
                folder.mkdir(parents=True, exist_ok=True)
                path = folder / f"layers-{layer_start}-{layer_end}.safetensors"
                tmp.replace(path)
                if self._latest_complete() == version:
                    self._prune(version)
                return path
        finally:
            tmp.unlink(missing_ok=True)

    def _blocks(self, version: int) -> dict[int, list[tuple[int, int, Path]]]:
        """Epoch -> its blocks at ``version``."""
        folder = self._dir(version)
        if not folder.is_dir():
            return {}
        out: dict[int, list[tuple[int, int, Path]]] = {}
        for sub in folder.iterdir():
            m = _EPOCH_DIR.match(sub.name)
            if not m or not sub.is_dir():
                continue
            found = [(int(f[1]), int(f[2]), p) for p in sub.iterdir() if (f := _FILE.match(p.name))]
            out[int(m[1])] = sorted(found)
        return out

    def _complete_epoch(self, version: int) -> int | None:
        """The newest epoch whose blocks at ``version`` make a whole model."""
        blocks = self._blocks(version)
        done = [e for e, found in blocks.items() if tiles([(a, b) for a, b, _ in found], self.n_layers)]
        return max(done) if done else None

    def _versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())

    def _latest_complete(self) -> int | None:
        done = [v for v in self._versions() if self._complete_epoch(v) is not None]
        return done[-1] if done else None

    def versions(self) -> list[int]:
        with self._lock:
            return self._versions()

    def is_complete(self, version: int) -> bool:
        with self._lock:
            return self._complete_epoch(version) is not None

    def latest_complete(self) -> int | None:
        with self._lock:
            return self._latest_complete()

    def fetch(self, version: int, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The requested parameters and their optimizer state at ``version``, all from one epoch's blocks."""
        wanted = set(names)
        weights: dict[str, torch.Tensor] = {}
        optim: dict[str, torch.Tensor] = {}
        with self._lock:
            epoch = self._complete_epoch(version)
            if epoch is None:
                raise KeyError(f"checkpoint v{version} is not complete")
            for _, _, path in self._blocks(version)[epoch]:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                        kind, _, name = key.partition("/")
                        if name.split("::", 1)[0] in wanted:
                            (weights if kind == "w" else optim)[name] = f.get_tensor(key)
        missing = wanted - set(weights)
        if missing:
            raise KeyError(f"checkpoint v{version} has no {sorted(missing)[:3]}")
        return weights, optim

    def _prune(self, complete: int) -> None:
        """Keep ``keep`` complete versions (this one and the newest older ones); drop everything older."""
        older = [v for v in self._versions() if v < complete]
        kept = [v for v in older if self._complete_epoch(v) is not None][-(self.keep - 1) :] if self.keep > 1 else []
        for v in older:
            if v not in kept:
                shutil.rmtree(self._dir(v), ignore_errors=True)

    def describe(self) -> dict:
        with self._lock:
            return {"latest_complete": self._latest_complete(), "versions": self._versions(), "epoch": self.epoch}

    def write_index(self) -> None:
        (self.root / "index.json").write_text(json.dumps(self.describe()))
