"""The rows activation deltas keep per sample: bounded in memory, spilled to an unlinked file, never beyond."""

import os

import pytest
import torch

from swarm.wire.sample_store import SampleStore, StoreFull

ROW = (16, 8)  # 128 values: 256 bytes a row in bf16


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *ROW), generator=torch.Generator().manual_seed(seed))


def test_rows_come_back_as_stored_in_bf16_and_replace() -> None:
    store = SampleStore(memory_bytes=256 * 10)
    x = rows(3)
    store.put([7, 3, 11], x)
    assert len(store) == 3 and 7 in store and 4 not in store and store.capacity == 10
    assert torch.equal(store.get([11, 7]), x[[2, 0]].bfloat16().float())
    y = rows(1, seed=1)
    store.put([3], y)
    assert len(store) == 3 and torch.equal(store.get([3]), y.bfloat16().float())


def test_rows_beyond_memory_spill_to_a_file_that_leaves_nothing_behind(tmp_path) -> None:
    store = SampleStore(memory_bytes=256 * 2, spill_bytes=256 * 5, spill_dir=str(tmp_path))
    x = rows(7)
    for i in range(7):
        store.put([100 + i], x[i : i + 1])
    assert store.capacity == 7 and store.spilled == 5
    assert torch.equal(store.get([106, 100, 103]), x[[6, 0, 3]].bfloat16().float())
    assert os.listdir(tmp_path) == []  # unlinked as soon as it was open
    with pytest.raises(StoreFull, match="no room"):
        store.put([200], rows(1))
    store.put([101], rows(1, seed=2))  # a sample held may always be replaced
    assert not store.room([200], ROW) and store.room([101, 102], ROW)


def test_a_full_store_and_a_row_of_another_shape_are_refused() -> None:
    store = SampleStore(memory_bytes=256 * 2)
    with pytest.raises(StoreFull, match="no room"):
        store.put([1, 2, 3], rows(3))
    assert len(store) == 0  # nothing of a refused put is kept
    store.put([1], rows(1))
    with pytest.raises(StoreFull, match="shape"):
        store.put([2], torch.zeros(1, 8, 8))
    assert not store.fits((8, 8)) and store.fits(ROW)


def test_a_store_of_no_bytes_holds_nothing() -> None:
    store = SampleStore(memory_bytes=0)
    assert not store.room([1], ROW)
    with pytest.raises(StoreFull):
        store.put([1], rows(1))
