"""The C allocator under a peer: jemalloc (or tcmalloc) when installed, because glibc's keeps what training frees.

A CPU peer allocates and frees activation-sized buffers (1-100 MiB) every micro-batch. glibc's malloc
serves those below its dynamic mmap threshold (up to 32 MiB) from its heaps, and a freed buffer below one
that is still live stays resident, so a peer's peak resident memory ran 1.2-3.4x what the memory model
counts and a plan's memory figures were not what a machine needed (docs/hf_scale.md). jemalloc reuses and
returns that memory: the same peers peaked at 0.97-1.13x the model. tcmalloc came close (1.02-1.24x) and
ran a little faster, but held 2.7x the live bytes where jemalloc held 1.0x on the pattern of
``tests/test_allocator.py``, so jemalloc comes first. An allocator replaces malloc only when the dynamic
linker preloads it at exec, so ``ravn local`` preloads it into the peers it starts and ``ravn-peer join``
executes itself again, once, with it. ``RAVN_ALLOCATOR`` picks one (``jemalloc``, ``tcmalloc``) or keeps
glibc's (``system``); a ``LD_PRELOAD`` that is already set is the user's choice and is left alone.

The same goes for PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages for CPU tensors of 2 MiB
and more): half of decoding a large tensor was page faults, which it removes (docs/codecs.md). PyTorch
reads it once, at its first large allocation, so a peer gets it in its environment from the start; a
value the user set stays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path

ENV = "RAVN_ALLOCATOR"
THP_ENV = "THP_MEM_ALLOC_ENABLE"
# Library names as the dynamic linker knows them, in order of preference: jemalloc (Debian: libjemalloc2),
# then gperftools' tcmalloc (libtcmalloc-minimal4), the two PyTorch's CPU launcher offers (torch.backends.xeon).
LIBRARIES = {"jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc_minimal", "tcmalloc")}
CHOICES = ("auto", *LIBRARIES, "system")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MALLCTL_ARENAS_ALL = 4096  # jemalloc: "arena.<this>.purge" purges every arena


def _choice(env: Mapping[str, str]) -> str:
    choice = env.get(ENV, "") or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    return choice


def preload_library(env: Mapping[str, str] = os.environ) -> str | None:
    """The shared library to preload for ``env``'s choice, as the linker finds it; None for glibc's malloc."""
    choice = _choice(env)
    if choice == "system" or not sys.platform.startswith("linux"):
        return None
    for name in LIBRARIES if choice == "auto" else (choice,):
        for lib in LIBRARIES[name]:
            if found := ctypes.util.find_library(lib):
                return found
    return None


def peer_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a peer process: huge pages on and the allocator preloaded, unless the user set either."""
    out = dict(env)
    out.setdefault(THP_ENV, "1")
    if out.get("LD_PRELOAD") or (lib := preload_library(out)) is None:
        return out
    out["LD_PRELOAD"] = lib
    if "tcmalloc" in lib:  # it reports every allocation over 1 GiB on stderr; a checkpoint's embedding is one
        out.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    return out


def exec_with_allocator() -> None:
    """Start this program again in a peer's environment (allocator, huge pages); returns when nothing changes.

    The new process finds its environment complete and returns from here, so this happens at most once. It keeps
    its PID, so a parent that waits for it (or tests that read its ``/proc``) see no difference.
    """
    env = peer_environment(os.environ)
    if all(os.environ.get(name) == value for name, value in env.items()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


@cache
def active_allocator() -> str:
    """Who serves malloc in this process: 'tcmalloc', 'jemalloc', 'glibc', or 'unknown' (no /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in LIBRARIES:
        if f"/lib{name}" in maps:
            return name
    return "glibc"


def _symbol(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


# glibc's mmap threshold while training: its own ceiling for the dynamic threshold (as if untouched), so freed
# activations of up to 32 MiB stay in its heap. A middle block of the 0.5 B benchmark (5 layers, 3
# micro-batches, one thread; docs/hf_scale.md) measured, threshold: seconds per step, peak over the built
# block: 32 MiB 1.71-1.85 s, 578 MiB; 1 MiB 2.06-2.30 s, 516 MiB; 128 KiB 2.64-3.23 s, 386 MiB; 4 KiB
# 2.64-2.69 s, 385 MiB (what autograd keeps: 365 MiB): a CPU peer pays 20-55 % in speed for any lower one.
TRAINING_MMAP_THRESHOLD = 32 << 20
BUILD_MMAP_THRESHOLD = 128 << 10
_jemalloc_decay: dict[int, int] = {}  # arena -> its dirty_decay_ms before a build set it to 0


def _mallctl_ssize(mallctl, key: str, value: int) -> int | None:
    """Write a jemalloc ``ssize_t`` setting; its previous value, or None where jemalloc refused."""
    old, new = ctypes.c_ssize_t(0), ctypes.c_ssize_t(value)
    size = ctypes.c_size_t(ctypes.sizeof(old))
    ok = mallctl(key.encode(), ctypes.byref(old), ctypes.byref(size), ctypes.byref(new), ctypes.sizeof(new)) == 0
    return old.value if ok else None


def hold_freed_memory(hold: bool) -> None:
    """Whether memory freed from now on stays with the allocator for reuse (training) or goes back to the OS.

    While a block is built, what is freed is a load's transient that nothing reuses, and a peak that kept
    them would break "the block plus one tensor in flight": glibc then maps every allocation over 128 KiB
    on its own and jemalloc purges freed pages at once (a last stage of the 0.5 B benchmark, built alone,
    peaked 14 MiB lower); training goes back to each allocator's own policy, which reuses freed memory.
    """
    allocator = active_allocator()
    if allocator == "glibc" and (mallopt := _symbol("mallopt")):
        mallopt(M_MMAP_THRESHOLD, TRAINING_MMAP_THRESHOLD if hold else BUILD_MMAP_THRESHOLD)
    elif allocator == "jemalloc" and (mallctl := _symbol("mallctl")):
        narenas, size = ctypes.c_uint(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))
        mallctl(b"arenas.narenas", ctypes.byref(narenas), ctypes.byref(size), None, ctypes.c_size_t(0))
        for arena in range(narenas.value):
            if hold and arena in _jemalloc_decay:
                _mallctl_ssize(mallctl, f"arena.{arena}.dirty_decay_ms", _jemalloc_decay.pop(arena))
            elif not hold and (old := _mallctl_ssize(mallctl, f"arena.{arena}.dirty_decay_ms", 0)) is not None:
                _jemalloc_decay.setdefault(arena, old)


def release_free_memory() -> None:
    """Give the free memory the allocator holds back to the OS, so that a baseline read next is the live bytes."""
    allocator = active_allocator()
    if allocator == "tcmalloc" and (release := _symbol("MallocExtension_ReleaseFreeMemory")):
        release()
    elif allocator == "jemalloc" and (mallctl := _symbol("mallctl")):
        mallctl(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, ctypes.c_size_t(0))
    elif allocator == "glibc" and (malloc_trim := _symbol("malloc_trim")):
        malloc_trim(0)
