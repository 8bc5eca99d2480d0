"""Time a short benchmark so that other processes on the same cores distort it as little as possible.

A peer measures itself at every start, often on cores it shares with other peers or programs. Interference
only ever makes a pass slower, never faster, so :func:`best_rate` keeps the fastest of a few short repeats:
that is the closest to what the machine can do, while a mean over one long run carries whatever else ran
meanwhile (identical peers started together on one machine measured 2-3x apart that way, and the planner
gave them unequal blocks). A few short repeats also bound the time: about half a second for a small layer.

Best-of alone is not enough when the other processes measure at the very same moment (``ravn local``
starts all its peers together): every repeat is then contended. On CPU the clock is therefore the
process's CPU time per torch thread (:func:`device_clock`): a pass costs the same CPU time however many
other processes share the cores, so identical peers measure alike (wall-clock rates of peers started
together on 2 cores spread 2.7x, CPU-time rates far less; see docs/planner.md). On CUDA the device is not
shared this way and the wall clock, after a synchronize, is right.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

REPEATS = 5  # timed repeats; the fastest one counts
REPEAT_SECONDS = 0.1  # each repeat runs at least one pass and at least this long
MAX_SECONDS = 3.0  # a layer too big for that stops after 2 repeats once this much time went by


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (CUDA runs asynchronously), so the clock sees finished passes."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def device_clock(device: torch.device) -> Callable[[], float]:
    """Seconds the pass would take with the device to itself: wall time on CUDA; on CPU the process's CPU
    time divided by torch's intra-op threads (their busy time is what a pass costs, contended or not)."""
    if device.type == "cuda":
        return time.perf_counter
    threads = max(torch.get_num_threads(), 1)
    return lambda: time.process_time() / threads


def best_rate(
    once: Callable[[], None],
    *,
    repeats: int = REPEATS,
    repeat_seconds: float = REPEAT_SECONDS,
    max_seconds: float = MAX_SECONDS,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Calls of ``once`` per second in the fastest of ``repeats`` timed repeats, after one warm-up call.

    Why the fastest: see the module docstring. The warm-up pays for allocations and kernel selection.
    """
    once()
    sync()
    start, best = clock(), 0.0
    for i in range(repeats):
        n, t0 = 0, clock()
        while n == 0 or clock() - t0 < repeat_seconds:
            once()
            n += 1
        sync()
        best = max(best, n / max(clock() - t0, 1e-9))
        if i >= 1 and clock() - start > max_seconds:
            break
    return best
