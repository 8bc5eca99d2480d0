"""The coordinator's block checkpoints: a restore never combines layers from two plans (two timelines)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator import checkpoint_store
from coordinator.checkpoint_store import CheckpointStore, StaleCheckpoint, tiles

NAMES = [f"layers.{i}.w" for i in range(6)]


def block(a: int, b: int, value: float) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.full((2,), value) for i in range(a, b)}


def values(store: CheckpointStore, version: int) -> list[float]:
    weights, _ = store.fetch(version, NAMES)
    return [float(weights[n][0]) for n in NAMES]


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def two_timelines(tmp_path: Path) -> CheckpointStore:
    """Epoch 1 completes v20, then dies at v25 with [0,2) and [2,4) uploaded and [4,6) not."""
    store = CheckpointStore(tmp_path, n_layers=6)
    old = store.begin_epoch(0)
    for a, b in ((0, 2), (2, 4), (4, 6)):
        store.save(old, 20, a, b, block(a, b, 1.0), {})
    store.save(old, 25, 0, 2, block(0, 2, 1.0), {})
    store.save(old, 25, 2, 4, block(2, 4, 1.0), {})
    return store


def test_a_new_plans_block_does_not_complete_a_version_with_the_dead_plans_blocks(tmp_path: Path) -> None:
    """The issue's reproduction: the new plan uploads [3,6) at v25 after a recovery from v20."""
    store = two_timelines(tmp_path)
    assert store.latest_complete() == 20
    new = store.begin_epoch(store.latest_complete())  # what a recovery does
    store.save(new, 25, 3, 6, block(3, 6, 2.0), {})
    assert not store.is_complete(25) and store.latest_complete() == 20
    with pytest.raises(KeyError, match="not complete"):
        store.fetch(25, NAMES)


def test_fetch_never_takes_a_layer_from_the_dead_plan(tmp_path: Path) -> None:
    store = two_timelines(tmp_path)
    new = store.begin_epoch(20)
    store.save(new, 25, 0, 3, block(0, 3, 2.0), {})
    store.save(new, 25, 3, 6, block(3, 6, 2.0), {})
    assert store.latest_complete() == 25
    assert values(store, 25) == [2.0] * 6


def test_starting_an_epoch_discards_the_versions_after_its_restore_point(tmp_path: Path) -> None:
    store = two_timelines(tmp_path)
    old = store.epoch
    store.save(old, 30, 0, 2, block(0, 2, 1.0), {})
    store.begin_epoch(20)
    assert store.versions() == [20]
    assert values(store, 20) == [1.0] * 6  # the restore point itself is kept


def test_only_one_epochs_blocks_make_a_version_complete(tmp_path: Path) -> None:
    """Two epochs at one version (a hand-over right after a restore): each is judged alone."""
    store = CheckpointStore(tmp_path, n_layers=6)
    old = store.begin_epoch(0)
    for a, b in ((0, 2), (2, 4), (4, 6)):
        store.save(old, 25, a, b, block(a, b, 1.0), {})
    new = store.begin_epoch(25)
    store.save(new, 25, 3, 6, block(3, 6, 2.0), {})
    assert values(store, 25) == [1.0] * 6  # still the old epoch's whole model, not layers 3..5 of the new
    store.save(new, 25, 0, 3, block(0, 3, 2.0), {})
    assert values(store, 25) == [2.0] * 6  # the newest complete epoch, and only its blocks


def test_overlapping_or_gapped_blocks_of_one_epoch_are_not_complete(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, n_layers=6)
    epoch = store.begin_epoch(0)
    store.save(epoch, 5, 0, 3, block(0, 3, 1.0), {})
    store.save(epoch, 5, 2, 6, block(2, 6, 1.0), {})
    assert not store.is_complete(5)
    assert tiles([(0, 3), (3, 6)], 6) and tiles([(3, 6), (0, 3)], 6)
    assert not tiles([(0, 3), (2, 6)], 6) and not tiles([(0, 2), (3, 6)], 6) and not tiles([(0, 3)], 6)
    assert not tiles([(0, 3), (3, 6), (3, 6)], 6)


def test_an_upload_from_an_old_epoch_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    store = two_timelines(tmp_path)
    old = store.epoch
    store.begin_epoch(20)
    before = files(tmp_path)
    for epoch in (old, old + 5):
        with pytest.raises(StaleCheckpoint, match=f"plan epoch {epoch}"):
            store.save(epoch, 25, 4, 6, block(4, 6, 1.0), {})
    assert files(tmp_path) == before


def test_a_recovery_while_a_block_is_being_written_refuses_it(tmp_path: Path, monkeypatch) -> None:
    store = two_timelines(tmp_path)
    old = store.epoch
    real = checkpoint_store.save_file

    def recovery_meanwhile(tensors, path, metadata=None) -> None:
        real(tensors, path, metadata=metadata)
        store.begin_epoch(20)

    monkeypatch.setattr(checkpoint_store, "save_file", recovery_meanwhile)
    with pytest.raises(StaleCheckpoint):
        store.save(old, 25, 4, 6, block(4, 6, 1.0), {})
    assert store.versions() == [20] and not store.is_complete(25)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".incoming")]


def test_the_epoch_survives_a_coordinator_restart(tmp_path: Path) -> None:
    store = two_timelines(tmp_path)
    epoch = store.begin_epoch(20)
    again = CheckpointStore(tmp_path, n_layers=6)
    assert again.epoch == epoch and again.latest_complete() == 20
    assert again.describe() == {"latest_complete": 20, "versions": [20], "epoch": epoch}
    (tmp_path / "epoch.json").write_text("{")
    with pytest.raises(ValueError, match="--fresh"):
        CheckpointStore(tmp_path, n_layers=6)


def test_pruning_keeps_the_two_newest_complete_versions(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, n_layers=6)
    epoch = store.begin_epoch(0)
    store.save(epoch, 5, 0, 6, block(0, 6, 1.0), {})
    store.save(epoch, 10, 0, 3, block(0, 3, 1.0), {})  # never completed
    store.save(epoch, 15, 0, 6, block(0, 6, 1.0), {})
    assert store.versions() == [5, 15]
    store.save(epoch, 20, 0, 6, block(0, 6, 1.0), {})
    assert store.versions() == [15, 20]
