"""Read a Hugging Face checkpoint directory one tensor at a time, by name, without loading the rest.

A peer that serves layers ``[a, b)`` of a 7B model must not need 14 GB of RAM to start, so nothing here
builds the whole model: the header of every ``*.safetensors`` shard (or ``model.safetensors.index.json``)
maps tensor names to files, and each tensor asked for is read, by its header offsets, into a buffer of its
own (:func:`read_tensor`), one at a time (:class:`LazyTensors`). Everything is read from a local
directory; nothing is ever downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(path: str | Path, *, attn_implementation: str = "sdpa"):  # -> transformers.PretrainedConfig
    """The checkpoint's ``config.json``, with the attention kernel chosen explicitly.

    Decoder layers built outside a ``PreTrainedModel`` never get an attention implementation assigned,
    and with none the mask helpers silently return no causal mask; so it is always set here.
    """
    from transformers import AutoConfig

    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json; expected a local Hugging Face checkpoint directory")
    config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    config._attn_implementation = attn_implementation
    return config


class CheckpointReader:
    """Name → shard map of a local safetensors checkpoint, reading tensors individually on demand."""

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path).expanduser()
        self.files = self._weight_map()
        self.read_names: list[str] = []
        self.largest_read_bytes = 0  # the largest single tensor read so far, in its stored dtype

    def _weight_map(self) -> dict[str, Path]:
        index = self.root / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.root / fname for name, fname in weight_map.items()}
        shards = sorted(self.root.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors files in {self.root} (pickled .bin checkpoints are not read)")
        files: dict[str, Path] = {}
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:  # reads the header only
                for name in f.keys():
                    files[name] = shard
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return sorted(self.files)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors in their stored dtype on the CPU, each an owned copy (see :meth:`read_one`)."""
        wanted = list(names)
        self._check(wanted)
        return {name: self.read_one(name) for name in wanted}

    def lazy(self, names: dict[str, str]) -> LazyTensors:
        """``{local key: checkpoint name}`` whose tensors are read only as they are taken, one at a time."""
        self._check(names.values())
        return LazyTensors(self, names)

    def read_one(self, name: str) -> torch.Tensor:
        """One tensor in its stored dtype, in memory this process owns (see :func:`read_tensor`)."""
        t = read_tensor(self.files[name], name)
        self.largest_read_bytes = max(self.largest_read_bytes, t.numel() * t.element_size())
        self.read_names.append(name)
        return t

    def _check(self, wanted: Iterable[str]) -> None:
        missing = [n for n in wanted if n not in self.files]
        if missing:
            raise KeyError(f"{self.root} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")


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
    (measured in docs/hf_scale.md).
    """
    with open(shard, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        if name not in header:
            raise KeyError(f"{shard} has no tensor {name!r}")
        info = header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{shard}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        f.seek(8 + n + begin)
        if f.readinto(memoryview(buf.numpy())) != end - begin:
            raise ValueError(f"{shard} is truncated at tensor {name!r}")
    return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


class LazyTensors:
    """A module's tensors by local key, each read from the checkpoint when taken (``pop``, ``items``).

    ``items()`` hands them out one at a time and forgets each, so a caller that converts (casts,
    quantises) as it iterates holds one stored tensor in flight, not a whole layer's.
    """

    def __init__(self, reader: CheckpointReader, names: dict[str, str]) -> None:
        self._reader, self._names = reader, dict(names)

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def __len__(self) -> int:
        return len(self._names)

    def keys(self) -> list[str]:
        return list(self._names)

    def pop(self, key: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        name = self._names.pop(key, None)
        return default if name is None else self._reader.read_one(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._names:
            key = next(iter(self._names))
            yield key, self.pop(key)
