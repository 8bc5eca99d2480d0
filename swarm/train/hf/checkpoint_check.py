"""Is this directory a Hugging Face checkpoint Ravn can fine-tune? Checked from headers alone, before any peer trains.

``check_checkpoint`` reads ``config.json``, the shard index and every safetensors header (never tensor
data, so a 70B checkpoint is checked in seconds), builds the decoder layers, the embeddings, the final
norm and the head on the meta device from the config exactly as ``HFStageModel`` does, and compares
every expected tensor's shape with the stored one. Whatever is wrong raises one ``CheckpointError``
whose message is one line naming the file or the limit; the coordinator prints it and exits, and a
peer whose local copy differs raises the same error when it loads its block (``loader.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from swarm.train.hf.arch import GPT2Family, LlamaFamily, architecture_class, architecture_for

INDEX_FILE = "model.safetensors.index.json"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them: the data source tokenizes
DEFAULT_CONTEXT = 512  # training sequence length when --context is not given (at most the model's positions)
# config.json keys each family cannot be built without (alternatives: the names GPT-2 uses)
REQUIRED_KEYS = {
    LlamaFamily: ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"),
    GPT2Family: (
        ("n_embd", "hidden_size"),
        ("n_layer", "num_hidden_layers"),
        ("n_head", "num_attention_heads"),
        "vocab_size",
    ),
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be fine-tuned; the message is one line naming the file or the limit."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def read_config_json(path: str | Path) -> dict:
    """``config.json`` as a dict, checked for a supported ``model_type`` and the keys its layers need."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    file = root / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: a Hugging Face checkpoint directory has one")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({_one_line(e)})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    model_type = config.get("model_type")
    if not model_type:
        raise CheckpointError(f"{file} has no model_type")
    try:
        family = architecture_class(str(model_type))
    except NotImplementedError as e:
        raise CheckpointError(f"{file}: {_one_line(e)}") from None
    for key in REQUIRED_KEYS[family]:
        names = key if isinstance(key, tuple) else (key,)
        if not any(n in config for n in names):
            raise CheckpointError(f"{file} lacks {names[0]!r}, which the {model_type} layers are built from")
    return config


def load_config(path: str | Path):  # -> transformers.PretrainedConfig
    """The ``transformers`` config of a checked ``config.json`` (CheckpointError for values it refuses)."""
    from transformers import AutoConfig

    root = Path(path).expanduser()
    read_config_json(root)
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise CheckpointError(f"{root / 'config.json'}: {_one_line(e)}") from None
    config._attn_implementation = "sdpa"
    return config


def positions(config) -> int:
    """The longest sequence the model was built for (0: the config does not say)."""
    return int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 0)


def default_context(path: str | Path) -> int:
    """The training sequence length when none is given: 512, or the checkpoint's positions if fewer."""
    limit = positions(load_config(path))
    return min(DEFAULT_CONTEXT, limit) if limit else DEFAULT_CONTEXT


def weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the shard holding it, from the index (shards must exist) or from every shard's header."""
    root = Path(path).expanduser()
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {str(name): root / str(fname) for name, fname in weight_map.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({_one_line(e)})") from None
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                names = [n for n, f in files.items() if f == shard]
                raise CheckpointError(f"{shard} is missing ({INDEX_FILE} names it for {len(names)} tensors)")
        return files
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for pattern in PICKLED for p in root.glob(pattern))
        if pickled:
            raise CheckpointError(
                f"{root} holds only pickled weights ({', '.join(pickled[:3])}{', ...' if len(pickled) > 3 else ''}), "
                "which are never read: convert them to safetensors (save_pretrained(..., safe_serialization=True))"
            )
        raise CheckpointError(f"{root} has no *.safetensors weights")
    files: dict[str, Path] = {}
    for shard, names in shard_headers(shards).items():
        files.update(dict.fromkeys(names, shard))
    return files


def shard_headers(shards: list[Path]) -> dict[Path, dict[str, tuple[int, ...]]]:
    """Every shard's tensor shapes, read from its header alone (CheckpointError names a truncated or corrupt one)."""
    out: dict[Path, dict[str, tuple[int, ...]]] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                out[shard] = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{shard} is truncated or corrupt ({_one_line(e)})") from None
    return out


def expected_shapes(config, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor a full set of blocks loads, with the shape the config implies (built on the meta device)."""
    import torch

    try:
        arch = architecture_for(config, names)
    except KeyError as e:  # the embedding is under neither prefix
        raise CheckpointError(str(e.args[0]) if e.args else "the checkpoint has no embedding tensor") from None
    except NotImplementedError as e:
        raise CheckpointError(_one_line(e)) from None
    out: dict[str, tuple[int, ...]] = {}
    try:
        with torch.device("meta"):
            for i in range(arch.n_layers):
                layer = arch.new_layer(i)
                prefix = arch.layer_tensor_prefix(i)
                out.update({prefix + k: tuple(t.shape) for k, t in layer.state_dict().items()})
            norm = arch.new_final_norm()
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"config.json cannot build a {config.model_type} layer: {_one_line(e)}") from None
    out.update({arch.norm_prefix + k: tuple(t.shape) for k, t in norm.state_dict().items()})
    out[arch.embed_key] = (arch.vocab_size, arch.hidden_size)
    if arch.pos_embed_key:
        out[arch.pos_embed_key] = (arch.context, arch.hidden_size)
    out[arch.head_key] = (arch.vocab_size, arch.hidden_size)
    return out


def check_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError (one line naming the file or the limit) unless every block of ``path`` can be loaded."""
    root = Path(path).expanduser()
    read_config_json(root)  # the files first: what they lack is said without importing transformers
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{root} has no tokenizer ({', '.join(TOKENIZER_FILES)}); the data is tokenized with it")
    files = weight_files(root)
    headers = shard_headers(sorted(set(files.values())))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shard in files.items():
        if name not in headers[shard]:
            raise CheckpointError(f"{shard} has no tensor {name}, which {INDEX_FILE} says it holds")
        shapes[name] = headers[shard][name]
    config = load_config(root)
    expected = expected_shapes(config, set(files))
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{root} lacks tensor {missing[0]}{more}, which config.json implies")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise CheckpointError(
                f"{files[name]}: tensor {name} has shape {list(shapes[name])}, but config.json implies {list(shape)}"
            )


def check_lora_targets(path: str | Path, targets: tuple[str, ...]) -> None:
    """Every name in ``targets`` (``--lora-targets``) must be a projection of the checkpoint's layers."""
    if not targets:
        return
    import torch

    from swarm.train.hf.lora import linear_features

    root = Path(path).expanduser()
    config = load_config(root)
    try:
        arch = architecture_for(config, set(weight_files(root)))
    except (KeyError, NotImplementedError) as e:
        raise CheckpointError(str(e.args[0]) if e.args else type(e).__name__) from None
    with torch.device("meta"):
        layer = arch.new_layer(0)
    names = sorted({n.rsplit(".", 1)[-1] for n, m in layer.named_modules() if n and linear_features(m) is not None})
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise CheckpointError(
            f"--lora-targets {','.join(unknown)}: no such projection in a {config.model_type} layer; "
            f"choose from {', '.join(names)}"
        )
