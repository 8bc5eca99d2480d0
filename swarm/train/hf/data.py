"""Fine-tuning data: a user's JSONL or plain text, tokenised by the checkpoint's own tokenizer.

Accepted inputs (a file, or a folder of them):

* ``*.jsonl`` — one object per line, either ``{"text": ...}`` (train on every token) or
  ``{"prompt": ..., "completion": ...}`` (train only on the completion: the prompt's targets are -100,
  which ``loss_sum`` ignores). Prompt and completion are tokenised separately, so the boundary is exact.
* any other text file — one document, trained on every token.

Every example ends with the tokenizer's EOS, so the model learns to stop. Two layouts:

* ``stream`` (default for text only): all examples joined into one token stream and read through
  random windows, exactly like ``swarm.train.data.Corpus``;
* ``rows`` (default when any prompt/completion pair exists): whole examples packed greedily into rows
  of ``context + 1`` tokens and padded (pad targets -100), so a completion that fits in a row is never cut
  from its prompt. An example longer than a row is split into row-sized pieces; rows left with no
  target at all (a piece of a long prompt) are dropped.

Examples packed into one row attend to the ones before them (only hidden states travel between
stages, so there is no per-row document mask). Batches are a pure function of (seed, split, step,
index), as in ``Corpus.batch``, so any run can be replayed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from swarm.train.data import (
    DEFAULT_CORPUS,
    STDLIB_CAP_BYTES,
    VALIDATION_FRACTION,
    sample_windows,
    stdlib_files,
    text_files,
)

IGNORE_INDEX = -100
DEFAULT_CAP_BYTES = 256 * 1024 * 1024
Example = tuple[np.ndarray, np.ndarray]  # token ids (int32), target mask (bool): may this token be predicted


def load_tokenizer(path: str | Path):  # -> transformers.PreTrainedTokenizerBase
    """The tokenizer stored beside the checkpoint; never downloaded."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(path).expanduser()), local_files_only=True)


def read_records(source: str | Path, cap_bytes: int = DEFAULT_CAP_BYTES) -> list[dict[str, str]]:
    """``{"text"}`` / ``{"prompt", "completion"}`` records from JSONL lines and plain-text files, in file order;
    ``stdlib``: the standard library's source, as the built-in GPT reads it (``swarm.train.data``)."""
    records: list[dict[str, str]] = []
    total = 0
    if str(source) == DEFAULT_CORPUS:
        files, cap_bytes = stdlib_files(), min(cap_bytes, STDLIB_CAP_BYTES)
    else:
        files = text_files(Path(source).expanduser())
    for f in files:
        raw = f.read_text(encoding="utf-8", errors="replace")
        total += len(raw)
        if f.suffix.lower() == ".jsonl":
            records.extend(_parse_jsonl(raw, f))
        elif raw.strip():
            records.append({"text": raw})
        if total >= cap_bytes:
            break
    if not records:
        raise ValueError(f"no examples in {source}")
    return records


def _parse_jsonl(raw: str, f: Path) -> list[dict[str, str]]:
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f}:{n}: not valid JSON ({exc.msg})") from exc
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            out.append({"text": obj["text"]})
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
            out.append({"prompt": obj["prompt"], "completion": obj["completion"]})
        else:
            raise ValueError(f'{f}:{n}: expected {{"text": str}} or {{"prompt": str, "completion": str}}')
    return out


def encode(record: dict[str, str], tokenizer) -> Example:
    """Token ids and target mask of one record; prompt tokens are never targets."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if "text" in record:
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"] + eos
        mask = [True] * len(ids)
    else:
        prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
        completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + eos
        ids, mask = prompt + completion, [False] * len(prompt) + [True] * len(completion)
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)


def _mix(seed: int, split: str, step: int, index: int) -> int:
    key = f"{seed}/{split}/{step}/{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _targets(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) from windows of ``context + 1`` tokens; non-target positions become -100."""
    ids = ids.long()
    return ids[:, :-1], torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE_INDEX))


def pack_rows(examples: list[Example], context: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy first-fit of whole examples into rows of ``context + 1`` tokens, padded; long ones are split.

    A long example's pieces overlap by one token (the last target of a piece is the first input of the
    next) and that overlapping token is never a target twice. Rows without any target are dropped.
    """
    width = context + 1
    rows_ids, rows_mask = [], []
    cur_ids: list[np.ndarray] = []
    cur_mask: list[np.ndarray] = []
    used = 0

    def flush() -> None:
        nonlocal used
        if used:
            ids = np.full(width, pad_id, dtype=np.int32)
            mask = np.zeros(width, dtype=bool)
            ids[:used], mask[:used] = np.concatenate(cur_ids), np.concatenate(cur_mask)
            rows_ids.append(ids)
            rows_mask.append(mask)
        cur_ids.clear()
        cur_mask.clear()
        used = 0

    for ids, mask in examples:
        for start in range(0, max(len(ids) - 1, 1), context):
            piece_ids, piece_mask = ids[start : start + width], mask[start : start + width].copy()
            if start:
                piece_mask[0] = False
            if used + len(piece_ids) > width:
                flush()
            cur_ids.append(piece_ids)
            cur_mask.append(piece_mask)
            used += len(piece_ids)
    flush()
    keep = [i for i, m in enumerate(rows_mask) if m[1:].any()]
    if not keep:
        raise ValueError("no example has a token to train on (empty completions?)")
    return np.stack([rows_ids[i] for i in keep]), np.stack([rows_mask[i] for i in keep])


class TokenCorpus:
    """Tokenised examples split into train/validation, serving ``(inputs, targets)`` batches like ``Corpus``."""

    def __init__(self, train: list[Example], val: list[Example], *, layout: str, pad_id: int) -> None:
        if layout not in ("stream", "rows"):
            raise ValueError(f"unknown layout {layout!r}; choose stream or rows")
        if not train:
            raise ValueError("no training examples")
        self.layout, self.pad_id = layout, pad_id
        self.splits = {"train": train, "val": val or train}
        digest = hashlib.sha256()
        for ids, mask in train + val:
            digest.update(ids.tobytes())
            digest.update(mask.tobytes())
        self.digest = digest.hexdigest()[:16]
        self._cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def load(cls, source: str | Path, tokenizer, *, layout: str = "auto", cap_bytes: int = DEFAULT_CAP_BYTES):
        """Read and tokenise ``source``; ``tokenizer`` is a tokenizer or the checkpoint directory holding one."""
        if isinstance(tokenizer, str | Path):
            tokenizer = load_tokenizer(tokenizer)
        records = read_records(source, cap_bytes)
        if layout == "auto":
            layout = "rows" if any("prompt" in r for r in records) else "stream"
        examples = [encode(r, tokenizer) for r in records]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pad = 0 if pad is None else pad
        if layout == "stream":  # split the joined tokens, like Corpus, so one long document still has a val part
            ids, mask = np.concatenate([e[0] for e in examples]), np.concatenate([e[1] for e in examples])
            cut = int(len(ids) * (1 - VALIDATION_FRACTION))
            return cls([(ids[:cut], mask[:cut])], [(ids[cut:], mask[cut:])], layout=layout, pad_id=pad)
        n_val = max(1, round(len(examples) * VALIDATION_FRACTION)) if len(examples) >= 2 else 0
        return cls(examples[: len(examples) - n_val], examples[len(examples) - n_val :], layout=layout, pad_id=pad)

    def _data(self, split: str, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (split, context if self.layout == "rows" else 0)
        if key not in self._cache:
            examples = self.splits[split]
            if self.layout == "rows":
                ids, mask = pack_rows(examples, context, self.pad_id)
            else:
                ids, mask = examples[0]
            self._cache[key] = torch.from_numpy(ids), torch.from_numpy(mask)
        return self._cache[key]

    def batch(
        self, *, split: str, seed: int, step: int, index: int, batch_size: int, context: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets (-100 where not trained), (batch, context) int64, fixed by the arguments."""
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}")
        ids, mask = self._data(split, context)
        g = torch.Generator()
        g.manual_seed(_mix(seed, split, step, index))
        if self.layout == "rows":
            rows = torch.randint(0, ids.shape[0], (batch_size,), generator=g)
            return _targets(ids[rows], mask[rows])
        if len(ids) <= context + 1:
            raise ValueError(f"{split} split of {len(ids)} tokens is shorter than the context {context}")
        starts = torch.randint(0, len(ids) - context - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(context + 1)[None, :]
        return _targets(ids[idx], mask[idx])

    def samples(self, *, seed: int, ids: list[int], context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training sequences ``ids`` of the fixed set (``--train-samples``): row j % rows of the packed rows,
        or the window at a position fixed by (seed, j) of the token stream."""
        tokens, mask = self._data("train", context)
        if self.layout == "rows":
            rows = torch.tensor([j % tokens.shape[0] for j in ids])
            return _targets(tokens[rows], mask[rows])
        idx = sample_windows(seed, ids, len(tokens), context)
        return _targets(tokens[idx], mask[idx])

    def target_count(self, targets: torch.Tensor) -> int:
        """Tokens that count in the loss: what the step's loss should be normalised by."""
        return int((targets != IGNORE_INDEX).sum())
