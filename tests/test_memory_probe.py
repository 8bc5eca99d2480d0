"""A stage's own memory numbers (swarm/train/memory.py) and the loader that keeps a load to its block."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from swarm.train.memory import MemoryProbe, block_bytes, proc_status, reset_peak

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
MiB = 1 << 20


@linux
def test_load_and_training_peaks_are_growth_over_the_footprint_before_the_build() -> None:
    if not reset_peak():
        pytest.skip("this kernel refuses /proc/self/clear_refs")
    probe = MemoryProbe("cpu")
    probe.before_build()
    scratch = torch.ones(64 * MiB // 4)  # 64 MiB held during the build only
    block = torch.nn.Linear(2048, 2048)  # 16 MiB kept
    del scratch
    probe.after_build(block)
    m = probe.memory
    assert m.hwm_reset
    assert m.block_bytes == block_bytes(block) == (2048 * 2048 + 2048) * 4
    assert 72 * MiB <= m.load_peak < 110 * MiB, m  # scratch and block were resident together
    assert m.train_peak < m.load_peak  # the peak was reset after the build
    held = torch.ones(32 * MiB // 4)  # "training" touches 32 MiB more
    assert probe.sample().train_peak >= m.resident_after_build + 30 * MiB
    del held


@linux
def test_a_built_block_keeps_no_checkpoint_shard_mapped(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from swarm.train.hf import HFStageModel
    from swarm.train.hf.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "llama", "llama", max_shard_size="40KB")
    probe = MemoryProbe("cpu")
    probe.before_build()
    for quant in ("none", "int8"):
        block = HFStageModel(ckpt, 1, 3, dtype="bf16", quant=quant)
        maps = Path("/proc/self/maps").read_text().splitlines()  # other tests' models may map their own files
        mapped = [line for line in maps if str(ckpt) in line and ".safetensors" in line]
        assert not mapped, mapped  # tensors were read into the block's own memory, no view pins a shard
        assert block.reader.largest_read_bytes == max(
            t.numel() * t.element_size() for t in block.reader.read([n for n in block.reader.read_names]).values()
        )
    assert proc_status()["VmRSS"] > 0


# the tiny checkpoint is stored in fp32, so a bf16 block converts every tensor it reads
@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_a_load_holds_one_stored_tensor_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str) -> None:
    """When the next tensor is read, every tensor read before it is converted and its stored copy gone.

    A stored tensor kept alive by a loop variable until the next read (two in flight) put the middle
    stages of the 0.5 B benchmark 1-2 MiB over "block plus one tensor" (docs/hf_scale.md)."""
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import weakref

    from swarm.train.hf import HFStageModel
    from swarm.train.hf.loader import CheckpointReader
    from swarm.train.hf.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "llama", "llama")
    read, alive_at_read = [], []
    original = CheckpointReader.read_one

    def read_one(self: CheckpointReader, name: str) -> torch.Tensor:
        alive_at_read.append({i for i, r in enumerate(read) if r() is not None})
        t = original(self, name)
        read.append(weakref.ref(t))
        return t

    monkeypatch.setattr(CheckpointReader, "read_one", read_one)
    HFStageModel(ckpt, 1, 3, dtype="bf16", quant=quant)  # a middle block
    in_flight = [len(alive) for alive in alive_at_read]  # stored copies still alive at each read
    assert len(read) > 4 and max(in_flight) == 0, in_flight
