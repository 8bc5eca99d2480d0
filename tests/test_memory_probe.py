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
