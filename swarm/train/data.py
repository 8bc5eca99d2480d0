"""The training text: byte-level tokens from a corpus every Python install already has.

Nothing is downloaded: by default the corpus is the standard library's own source files, read in a
fixed order; ``--data PATH`` points at a user's text file or folder instead. Batches are a pure
function of (seed, split, step, index), so any run can be replayed and compared exactly.
"""

from __future__ import annotations

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


def _stdlib_files() -> list[Path]:
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
        files = _stdlib_files() if source == DEFAULT_CORPUS else text_files(Path(source).expanduser())
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


def _mix(seed: int, split: str, step: int, index: int) -> int:
    key = f"{seed}/{split}/{step}/{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
