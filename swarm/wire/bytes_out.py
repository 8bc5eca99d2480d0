"""A ``bytes`` object the encoder writes into directly, so a payload is produced by one pass, not two.

Why: the protobuf ``bytes`` field wants a ``bytes`` object, and the only way torch or numpy offer to
make one is to copy a finished tensor (``tobytes``): one more pass over the payload and one more
freshly faulted buffer. CPython can instead hand out an uninitialised ``bytes`` of a given size
(``PyBytes_FromStringAndSize(NULL, n)``, documented for exactly this: fill it before anyone else sees
it). :func:`new_bytes` returns such an object and a writable uint8 tensor over its memory; the encoder
writes the payload into the tensor, drops the tensor and returns the ``bytes``. Where ``ctypes.pythonapi``
is missing (not CPython) it falls back to a copy.

Large buffers come from glibc's ``mmap`` and page-fault on first touch, 4 KiB at a time. When the
process runs with PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` (peers do), the buffer is advised to use
transparent huge pages, as torch does for its own allocations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14

try:
    _from_string_and_size = ctypes.pythonapi.PyBytes_FromStringAndSize
    _from_string_and_size.restype = ctypes.py_object
    _from_string_and_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _as_string = ctypes.pythonapi.PyBytes_AsString
    _as_string.restype = ctypes.c_void_p
    _as_string.argtypes = (ctypes.py_object,)
    IN_PLACE = True
except (AttributeError, OSError):  # pragma: no cover - not CPython
    IN_PLACE = False

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if os.name == "posix" else None
_thp = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and _libc is not None and hasattr(_libc, "madvise")


def new_bytes(nbytes: int) -> tuple[bytes, torch.Tensor | None]:
    """``(data, view)``: a new ``bytes`` of ``nbytes`` and a writable uint8 view of it (None if unsupported).

    The caller must fill all of ``view`` and drop it before ``data`` is shared; ``view`` does not keep
    ``data`` alive, so ``data`` must stay referenced while ``view`` is used.
    """
    if not IN_PLACE or nbytes == 0:
        return b"", None
    data = _from_string_and_size(None, nbytes)
    addr = _as_string(data)
    if _thp and nbytes >= 2 * _HUGE:
        start = -(-addr // _HUGE) * _HUGE
        length = (addr + nbytes - start) // _HUGE * _HUGE
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return data, torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def tensor_bytes(x: torch.Tensor) -> bytes:
    """The bytes of ``x`` (any dtype, device, layout) in C order, copied once."""
    x = x.detach().reshape(-1)
    data, view = new_bytes(x.numel() * x.element_size())
    if view is None:
        return x.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    view.view(x.dtype).copy_(x)
    return data
