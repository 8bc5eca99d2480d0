"""Read a Hugging Face checkpoint directory one tensor at a time, by name, without loading the rest.

A peer that serves layers ``[a, b)`` of a 7B model must not need 14 GB of RAM to start, so nothing here
builds the whole model: the header of every ``*.safetensors`` shard (or ``model.safetensors.index.json``)
maps tensor names to files, and each tensor asked for is read, by its header offsets, into a buffer of its
own (:func:`read_tensor`), one at a time (:class:`LazyTensors`). Everything is read from a local
directory; nothing is ever downloaded.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from swarm.train.hf.checkpoint_check import INDEX_FILE, CheckpointError, load_config, weight_files

__all__ = ["INDEX_FILE", "CheckpointError", "CheckpointReader", "load_hf_config"]


def load_hf_config(path: str | Path, *, attn_implementation: str = "sdpa"):  # -> transformers.PretrainedConfig
    """The checkpoint's ``config.json``, with the attention kernel chosen explicitly.

    Decoder layers built outside a ``PreTrainedModel`` never get an attention implementation assigned,
    and with none the mask helpers silently return no causal mask; so it is always set here. A missing or
    unusable ``config.json`` is a ``CheckpointError`` naming it.
    """
    config = load_config(path)
    config._attn_implementation = attn_implementation
    return config


class CheckpointReader:
    """Name → shard map of a local safetensors checkpoint, reading tensors individually on demand.

    Everything wrong with the files (no shards, a shard the index names missing or corrupt, a tensor
    missing) is a ``CheckpointError`` naming the file: a peer's local copy may differ from the one the
    coordinator checked.
    """

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path).expanduser()
        self.files = weight_files(self.root)  # the index, or every shard's header
        self.read_names: list[str] = []
        self.largest_read_bytes = 0  # the largest single tensor read so far, in its stored dtype

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return sorted(self.files)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors in their stored dtype on the CPU, each an owned copy (see :meth:`read_one`)."""
        wanted = list(names)
        self._check(wanted)
        return {name: self.read_one(name) for name in wanted}

    def lazy(self, names: dict[str, str], check: Callable[[str, torch.Tensor], None] | None = None) -> LazyTensors:
        """``{local key: checkpoint name}`` whose tensors are read only as they are taken, one at a time;
        ``check(key, tensor)`` sees each as it is read (and may raise)."""
        self._check(names.values())
        return LazyTensors(self, names, check)

    def read_one(self, name: str) -> torch.Tensor:
        """One tensor in its stored dtype, in memory this process owns (see :func:`read_tensor`)."""
        t = read_tensor(self.files[name], name)
        self.largest_read_bytes = max(self.largest_read_bytes, t.numel() * t.element_size())
        self.read_names.append(name)
        return t

    def _check(self, wanted: Iterable[str]) -> None:
        missing = [n for n in wanted if n not in self.files]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.root} lacks tensor {missing[0]}{more}")


_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_tensor(shard: Path, name: str) -> torch.Tensor:
    """Read one tensor of a safetensors shard straight into a buffer of its own, without a memory map.

    ``safe_open(...).get_tensor`` returns a view of the shard's memory map: every page it touches counts
    as this process's ``RssFile`` while the mapping lives, a view kept in the block keeps it alive, and
    copying out of it holds the tensor twice (its mapped pages and the copy). Reading the bytes with
    ``readinto`` holds the tensor once; a load then holds the block plus about one tensor in flight
    (docs/finetune.md). A truncated or corrupt shard is a ``CheckpointError`` naming it.
    """
    stat = os.stat(shard)
    data_start, header = _header(str(shard), stat.st_size, stat.st_mtime_ns)
    if name not in header:
        raise CheckpointError(f"{shard} has no tensor {name}, which {INDEX_FILE} says it holds")
    info = header[name]
    begin, end = info["data_offsets"]
    buf = torch.empty(end - begin, dtype=torch.uint8)
    with open(shard, "rb") as f:
        f.seek(data_start + begin)
        if f.readinto(memoryview(buf.numpy())) != end - begin:
            raise CheckpointError(f"{shard} is truncated or corrupt (short read at {name})")
    return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


@functools.lru_cache(maxsize=64)
def _header(shard: str, size: int, mtime_ns: int) -> tuple[int, dict]:
    """(offset of the data, tensor entries) of a shard, checked as ``safe_open`` checks it: the entries
    must tile the data exactly, so a truncated file is refused whichever tensor is asked for."""
    try:
        with safe_open(shard, framework="pt"):  # safetensors' own header validation
            pass
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        spans = sorted(tuple(v["data_offsets"]) for v in header.values())
        bad = [k for k, v in header.items() if v["dtype"] not in _DTYPES]
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        why = str(e).splitlines()[0] if str(e) else repr(e)
        raise CheckpointError(f"{shard} is truncated or corrupt ({why})") from None
    if bad:
        raise CheckpointError(f"{shard}: tensor {bad[0]} has a dtype this loader does not read")
    gaps = any(b != a for (_, a), (b, _) in zip(spans, spans[1:], strict=False))
    if spans and (spans[0][0] != 0 or spans[-1][1] != size - 8 - n or gaps):
        raise CheckpointError(f"{shard} is truncated or corrupt (its header does not tile the data)")
    return 8 + n, header


class LazyTensors:
    """A module's tensors by local key, each read from the checkpoint when taken (``pop``) and then forgotten,
    so a caller that converts (casts, quantises) each before it takes the next, keeping no name bound to the
    stored copy, holds one stored tensor in flight, not a whole layer's.
    """

    def __init__(
        self, reader: CheckpointReader, names: dict[str, str], check: Callable[[str, torch.Tensor], None] | None = None
    ) -> None:
        self._reader, self._names, self._on_read = reader, dict(names), check

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def __len__(self) -> int:
        return len(self._names)

    def keys(self) -> list[str]:
        return list(self._names)

    def pop(self, key: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        name = self._names.pop(key, None)
        if name is None:
            return default
        t = self._reader.read_one(name)
        if self._on_read is not None:
            self._on_read(key, t)
        return t
