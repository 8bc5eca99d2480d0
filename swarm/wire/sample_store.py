"""Cached activation rows by training-sample index: a bounded number in memory, more in a file on disk.

Activation deltas (``sample_deltas.py``) need, on each side of a link, the last row the two sides agreed on
for every sample of the training set. For a fine-tuning set that is the set's size times one sequence's
activations: 64 KiB per sequence at gpt-medium's boundary, 32 MiB for a 2,048-token sequence of a model
8,192 wide, so a set of thousands outgrows memory. Rows are kept in bf16 (an activation's whole range; what
its rounding loses is sent with the next delta), the first ones in memory and those beyond ``memory_bytes``
in a file of ``spill_bytes`` at most. The file is unlinked as soon as it is open: a crash leaves nothing.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

_GROWTH = 64  # rows allocated at a time in memory, so a small set never reserves the whole budget


class StoreFull(ValueError):
    """More distinct samples than the store has room for."""


class SampleStore:
    """Rows of one shape by sample index, ``memory_bytes`` of them in memory and ``spill_bytes`` on disk."""

    def __init__(self, memory_bytes: int, spill_bytes: int = 0, spill_dir: str | None = None) -> None:
        self.memory_bytes, self.spill_bytes, self.spill_dir = memory_bytes, spill_bytes, spill_dir
        self.shape: tuple[int, ...] | None = None  # of one row: fixed by the first put
        self._slot: dict[int, int] = {}
        self._memory = torch.empty(0)
        self._disk: np.memmap | None = None
        self._memory_rows = self._disk_rows = 0

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, sample: int) -> bool:
        return sample in self._slot

    @property
    def capacity(self) -> int:
        """How many samples fit (0 until the row shape is known)."""
        return self._memory_rows + self._disk_rows

    @property
    def spilled(self) -> int:
        """Samples held on disk."""
        return max(0, len(self._slot) - self._memory_rows)

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether rows of ``shape`` can be stored: the store's row shape, or none yet."""
        return self.shape is None or self.shape == tuple(shape)

    def room(self, samples: list[int], shape: tuple[int, ...]) -> bool:
        """Whether :meth:`put` of ``samples`` with rows of ``shape`` would succeed."""
        if not self.fits(shape):
            return False
        new = len({s for s in samples if s not in self._slot})
        return len(self._slot) + new <= (self.capacity if self.shape is not None else self._rows_for(shape))

    def get(self, samples: list[int]) -> torch.Tensor:
        """The rows of ``samples`` as float32, one per sample (KeyError for one not held)."""
        assert self.shape is not None
        out = torch.empty((len(samples), *self.shape), dtype=torch.float32)
        for i, s in enumerate(samples):
            out[i] = self._row(self._slot[s]).view(self.shape)
        return out

    def put(self, samples: list[int], rows: torch.Tensor) -> None:
        """Hold ``rows[i]`` as sample ``samples[i]``'s row (replacing it); StoreFull beyond the capacity."""
        shape = tuple(rows.shape[1:])
        if not self.room(samples, shape):
            if not self.fits(shape):
                raise StoreFull(f"rows of shape {shape} in a store of rows {self.shape}")
            raise StoreFull(f"{len(self._slot)} samples held, no room for more (capacity {self.capacity})")
        if self.shape is None:
            self.shape = shape
            self._split(self._rows_for(shape))
        flat = rows.detach().reshape(len(samples), -1).to("cpu", torch.bfloat16)
        for s, row in zip(samples, flat, strict=True):
            slot = self._slot.setdefault(s, len(self._slot))
            self._write(slot, row)

    def close(self) -> None:
        """Free the memory and the file's pages (the file itself is already unlinked)."""
        self._slot.clear()
        self._memory, self._disk = torch.empty(0), None

    def _rows_for(self, shape: tuple[int, ...]) -> int:
        per_row = 2 * max(1, int(np.prod(shape)))
        return self.memory_bytes // per_row + self.spill_bytes // per_row

    def _split(self, rows: int) -> None:
        per_row = 2 * int(np.prod(self.shape))
        self._memory_rows = min(rows, self.memory_bytes // per_row)
        self._disk_rows = rows - self._memory_rows

    def _row(self, slot: int) -> torch.Tensor:
        if slot < self._memory_rows:
            return self._memory[slot]
        return torch.from_numpy(np.array(self._disk[slot - self._memory_rows])).view(torch.bfloat16)

    def _write(self, slot: int, row: torch.Tensor) -> None:
        if slot < self._memory_rows:
            if slot >= len(self._memory):
                grown = min(self._memory_rows, max(_GROWTH, 2 * len(self._memory)))
                memory = torch.empty((grown, row.numel()), dtype=torch.bfloat16)
                if len(self._memory):
                    memory[: len(self._memory)] = self._memory
                self._memory = memory
            self._memory[slot] = row
            return
        if self._disk is None:
            self._disk = self._open_file(row.numel())
        self._disk[slot - self._memory_rows] = row.view(torch.int16).numpy()

    def _open_file(self, numel: int) -> np.memmap:
        fd, path = tempfile.mkstemp(prefix="ravn-deltas-", suffix=".rows", dir=self.spill_dir)
        try:
            with os.fdopen(fd, "wb+") as f:  # sparse: pages are written as rows spill, not reserved
                f.truncate(self._disk_rows * numel * 2)
                return np.memmap(f, dtype=np.int16, mode="r+", shape=(self._disk_rows, numel))
        finally:
            os.unlink(path)
