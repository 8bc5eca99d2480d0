"""What a peer measures about itself before it joins: device, free memory, compute throughput.

The planner needs comparable numbers from very different machines, so the benchmark is the real
work at the model's width: forward and backward of one transformer layer on a micro-batch.
"""

from __future__ import annotations

import os
import time

import torch

from swarm.config import ModelConfig
from swarm.model import TransformerLayer


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} {torch.cuda.get_device_name(torch.device(device))}"[:128]
    return "cpu"


def free_memory_bytes(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 0


def layer_throughput(cfg: ModelConfig, device: str, *, batch: int = 4, seconds: float = 0.5) -> float:
    """Forward+backward passes of one layer per second on a (batch, context) micro-batch."""
    dev = torch.device(device)
    layer = TransformerLayer(cfg).to(dev)
    x = torch.randn(batch, cfg.context, cfg.d_model, device=dev, requires_grad=True)

    def once() -> None:
        layer(x).sum().backward()

    once()  # warm-up: allocations, kernels
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        once()
        n += 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return n / (time.perf_counter() - t0)
