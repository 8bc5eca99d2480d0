"""The training text: byte-level tokens from a corpus every Python install already has.

Nothing is downloaded: by default the corpus is the standard library's own source files, read in a
fixed order; ``--data PATH`` points at a user's text file or folder instead. Batches are a pure
function of (seed, split, step, index), so any run can be replayed and compared exactly.

``--train-samples N`` trains on a fixed set of N sequences instead, seen epoch after epoch in a fresh
order each time (:func:`epoch_samples`), the way a fine-tuning set is: each sequence has an index that
returns, which is what lets a link send an activation as its change since the last epoch.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_CORPUS = "stdlib"
STDLIB_CAP_BYTES = 8 * 1024 * 1024
VALIDATION_FRACTION = 0.05
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".csv", ".html", ".c", ".h", ".toml"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_files(path: Path) -> list[Path]:
    """A user's data: the file itself, or every text file under a folder, in a fixed order."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if files:
            return files
        raise ValueError(f"no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under {path}")
    raise FileNotFoundError(f"data path {path} does not exist")


@dataclass(frozen=True)
class Corpus:
    """Byte tokens split deterministically into a training and a validation part."""

    train: torch.Tensor
    val: torch.Tensor
    digest: str

    @classmethod
    def load(cls, source: str = DEFAULT_CORPUS, cap_bytes: int = STDLIB_CAP_BYTES) -> Corpus:
        files = stdlib_files() if source == DEFAULT_CORPUS else text_files(Path(source).expanduser())
        chunks, total = [], 0
        for f in files:
            try:
                data = f.read_bytes()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= cap_bytes:
                break
        blob = b"\n".join(chunks)[:cap_bytes]
        if len(blob) < 1024:
            raise ValueError(f"corpus {source!r} has only {len(blob)} bytes; at least 1 KiB is needed")
        tokens = torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy())
        split = int(len(tokens) * (1 - VALIDATION_FRACTION))
        return cls(tokens[:split], tokens[split:], hashlib.sha256(blob).hexdigest()[:16])

    def batch(
        self, *, split: str, seed: int, step: int, index: int, batch_size: int, context: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, (batch, context) int64, fixed by the arguments alone."""
        data = self.train if split == "train" else self.val
        if len(data) <= context + 1:
            raise ValueError(f"{split} split of {len(data)} tokens is shorter than the context {context}")
        g = torch.Generator()
        g.manual_seed(_mix(seed, split, step, index))
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(context + 1)[None, :]
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]

    def samples(self, *, seed: int, ids: list[int], context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of training sequences ``ids`` of the fixed set: sequence j is the window at a
        position fixed by (seed, j) alone."""
        window = self.train[sample_windows(seed, ids, len(self.train), context)].long()
        return window[:, :-1], window[:, 1:]


def sample_windows(seed: int, ids: list[int], length: int, context: int) -> torch.Tensor:
    """Token positions (len(ids), context + 1) of training sequences ``ids`` in a split of ``length`` tokens:
    sequence j is the window at a position fixed by (seed, j) alone."""
    if length <= context + 1:
        raise ValueError(f"train split of {length} tokens is shorter than the context {context}")
    starts = torch.tensor([_mix(seed, "sample", j, 0) % (length - context - 1) for j in ids])
    return starts[:, None] + torch.arange(context + 1)[None, :]


def epoch_samples(seed: int, n: int, position: int, count: int) -> list[int]:
    """The indices of training sequences ``position .. position + count`` of the run, over a set of ``n``
    seen in a fresh seeded order each epoch (a micro-batch may straddle two epochs)."""
    if n <= 0:
        raise ValueError(f"a training set needs at least one sequence, got {n}")
    out: list[int] = []
    while len(out) < count:
        epoch, at = divmod(position + len(out), n)
        order = _epoch_order(seed, n, epoch)
        out.extend(order[at : at + count - len(out)])
    return out


@functools.lru_cache(maxsize=4)  # a run reads one epoch at a time, and the next as a micro-batch straddles them
def _epoch_order(seed: int, n: int, epoch: int) -> list[int]:
    g = torch.Generator()
    g.manual_seed(_mix(seed, "epoch", epoch, n))
    return torch.randperm(n, generator=g).tolist()


def _mix(seed: int, split: str, step: int, index: int) -> int:
    key = f"{seed}/{split}/{step}/{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
