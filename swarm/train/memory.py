"""A stage's own memory, measured in its process: before building its block, the build's peak, training's peak.

Linux's ``VmHWM`` (peak resident set) is per process and can be reset to the current ``VmRSS`` by writing
``5`` to ``/proc/self/clear_refs``; so the build's peak and training's peak are measured apart, each as
growth over the resident memory just before the block was built. Resident memory counts a memory-mapped
checkpoint's pages too (``RssFile``) while they are mapped. On CUDA the same three numbers come from
``torch.cuda.memory_allocated`` and ``max_memory_allocated`` (reset with ``reset_peak_memory_stats``).

Off Linux (no ``/proc``) every host number is 0 and ``hwm_reset`` is False: nothing is guessed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from swarm.allocator import active_allocator, hold_freed_memory, release_free_memory

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def proc_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of this process in bytes (empty off Linux)."""
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in _FIELDS:
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current ``VmRSS``; False where the kernel refuses (or there is no /proc)."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


@dataclass
class StageMemory:
    """Bytes; every ``*_peak`` and ``resident_after_build`` is growth over the ``*_before`` of the same process."""

    rss_before: int = 0  # VmRSS just before the block was built
    anon_before: int = 0  # RssAnon at that moment
    load_peak: int = 0  # VmHWM growth while building the block
    resident_after_build: int = 0  # VmRSS growth once built
    anon_after_build: int = 0  # RssAnon growth once built (memory the block owns, not mapped file pages)
    train_peak: int = 0  # VmHWM growth up to now (since the build, whose peak is load_peak)
    cuda_before: int = 0
    cuda_load_peak: int = 0
    cuda_train_peak: int = 0
    block_bytes: int = 0  # the frozen base and trainable weights the block holds
    largest_tensor_bytes: int = 0  # the largest single tensor read from the checkpoint (stored dtype)
    hwm_reset: bool = False  # VmHWM could be reset, so train_peak excludes the build
    allocator: str = ""  # who serves malloc (swarm/allocator.py): glibc's keeps freed memory, the others reuse it

    def as_dict(self) -> dict:
        return asdict(self)


class MemoryProbe:
    """Call :meth:`before_build`, build, :meth:`after_build`, then :meth:`sample` whenever stats are reported.

    All on the thread that builds and trains (the compute thread), so the numbers are that work's.
    """

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.memory = StageMemory()

    def before_build(self) -> None:
        """Reset the peaks and take the baseline.

        An allocator keeps freed memory for reuse (glibc's heap held 109 MiB anonymous for an fp32 block of
        87 MiB), so during the build what the load frees goes back to the OS (swarm/allocator.py).
        """
        m = self.memory
        m.allocator = active_allocator()
        hold_freed_memory(False)
        release_free_memory()  # heap freed earlier (e.g. a previous block) is not this block's baseline
        m.hwm_reset = reset_peak()
        status = proc_status()
        m.rss_before, m.anon_before = status.get("VmRSS", 0), status.get("RssAnon", 0)
        if _cuda(self.device):
            torch.cuda.synchronize(self.device)
            m.cuda_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def after_build(self, model: torch.nn.Module) -> None:
        m = self.memory
        release_free_memory()
        hold_freed_memory(True)
        status = proc_status()
        m.load_peak = status.get("VmHWM", 0) - m.rss_before
        m.resident_after_build = status.get("VmRSS", 0) - m.rss_before
        m.anon_after_build = status.get("RssAnon", 0) - m.anon_before
        m.block_bytes = block_bytes(model)
        reader = getattr(model, "reader", None)
        m.largest_tensor_bytes = getattr(reader, "largest_read_bytes", 0) or largest_tensor_bytes(model)
        m.hwm_reset = m.hwm_reset and reset_peak()  # training's peak starts from the built block
        if _cuda(self.device):
            torch.cuda.synchronize(self.device)
            m.cuda_load_peak = torch.cuda.max_memory_allocated(self.device) - m.cuda_before
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sample()

    def sample(self) -> StageMemory:
        """Update the training peak (cheap: one read of /proc/self/status)."""
        m = self.memory
        hwm = proc_status().get("VmHWM", 0)
        m.train_peak = max(m.train_peak, hwm - m.rss_before) if hwm else 0
        if _cuda(self.device):
            m.cuda_train_peak = max(m.cuda_train_peak, torch.cuda.max_memory_allocated(self.device) - m.cuda_before)
        return m


def _unique(model: torch.nn.Module):
    seen = set()
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            yield t


def block_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (shared storage once): what the block holds at rest."""
    return sum(t.numel() * t.element_size() for t in _unique(model))


def largest_tensor_bytes(model: torch.nn.Module) -> int:
    return max((t.numel() * t.element_size() for t in _unique(model)), default=0)
