"""Fine-tuning data: JSONL text and prompt/completion records tokenised with the checkpoint's tokenizer,
completion-only targets, deterministic batches, and a loss that ignores -100."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from swarm.train.hf import HFStageModel, TokenCorpus, load_tokenizer  # noqa: E402
from swarm.train.hf.data import IGNORE_INDEX, encode, pack_rows, read_records  # noqa: E402
from swarm.train.hf.tiny import SAMPLE_TEXT, make_tiny_checkpoint  # noqa: E402

PAIRS = [
    {"prompt": f"Question: what is {a} plus {b}? Answer:", "completion": f" {a + b}."}
    for a in range(5)
    for b in range(4)
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hf-data") / "llama", "llama")


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return load_tokenizer(ckpt)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_prompt_completion_targets_only_the_completion(tmp_path, ckpt, tokenizer):
    corpus = TokenCorpus.load(write_jsonl(tmp_path / "qa.jsonl", PAIRS), ckpt)
    assert corpus.layout == "rows"
    ids, targets = corpus.batch(split="train", seed=0, step=0, index=0, batch_size=6, context=48)
    assert ids.shape == targets.shape == (6, 48) and ids.dtype == targets.dtype == torch.int64
    for row_ids, row_targets in zip(ids, targets, strict=True):
        kept = row_targets[row_targets != IGNORE_INDEX].tolist()
        text = tokenizer.decode(kept)
        assert text.endswith(tokenizer.eos_token) and text.count(".") == 1  # " 7.<eos>": completion + EOS only
        answer = text.removesuffix(tokenizer.eos_token)
        prompt = tokenizer.decode(row_ids[: int((row_targets != IGNORE_INDEX).nonzero()[0])].tolist())
        a, b = (int(s) for s in prompt.split("what is ")[1].split("?")[0].split(" plus "))
        assert answer == f" {a + b}."
        # where a target is kept it is the next input token (targets are the inputs shifted by one)
        nxt = torch.cat([row_ids[1:], row_ids[-1:]])
        keep = row_targets != IGNORE_INDEX
        assert torch.equal(row_targets[keep][:-1], nxt[keep][:-1])


def test_batches_are_a_function_of_seed_step_index(tmp_path, ckpt):
    corpus = TokenCorpus.load(write_jsonl(tmp_path / "qa.jsonl", PAIRS), ckpt)
    args = dict(split="train", batch_size=8, context=48)
    a = corpus.batch(seed=1, step=3, index=2, **args)
    assert all(torch.equal(x, y) for x, y in zip(a, corpus.batch(seed=1, step=3, index=2, **args), strict=True))
    assert not torch.equal(a[0], corpus.batch(seed=1, step=3, index=3, **args)[0])
    again = TokenCorpus.load(tmp_path / "qa.jsonl", ckpt)
    assert again.digest == corpus.digest
    assert torch.equal(again.batch(seed=1, step=3, index=2, **args)[0], a[0])
    val_ids, _ = corpus.batch(split="val", seed=0, step=0, index=0, batch_size=2, context=48)
    assert val_ids.shape == (2, 48)


def test_text_records_and_plain_text_files_train_on_every_token(tmp_path, ckpt, tokenizer):
    rows = [{"text": s} for s in SAMPLE_TEXT * 8]
    corpus = TokenCorpus.load(write_jsonl(tmp_path / "docs.jsonl", rows), ckpt)
    assert corpus.layout == "stream"
    ids, targets = corpus.batch(split="train", seed=0, step=0, index=0, batch_size=4, context=32)
    assert torch.equal(targets[:, :-1], ids[:, 1:]) and bool((targets != IGNORE_INDEX).all())

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text(" ".join(SAMPLE_TEXT) * 10)
    (folder / "b.md").write_text("# notes\n" + " ".join(SAMPLE_TEXT) * 10)
    (folder / "ignored.bin").write_bytes(b"\0\1")
    records = read_records(folder)
    assert len(records) == 2 and all(set(r) == {"text"} for r in records)
    stream = TokenCorpus.load(folder, tokenizer)
    ids, targets = stream.batch(split="val", seed=0, step=0, index=0, batch_size=2, context=16)
    assert torch.equal(targets[:, :-1], ids[:, 1:])


def test_long_examples_are_split_without_losing_or_repeating_targets(tokenizer):
    long = {"prompt": "Question: " + SAMPLE_TEXT[1], "completion": " " + " ".join(SAMPLE_TEXT)}
    short = {"prompt": "Q:", "completion": " yes."}
    examples = [encode(r, tokenizer) for r in (long, short, short)]
    want = sum(int(m[1:].sum()) for _, m in examples)  # every completion token after the first position
    rows_ids, rows_mask = pack_rows(examples, context=16, pad_id=0)
    assert rows_ids.shape[1] == 17 and int(rows_mask[:, 1:].sum()) == want
    assert rows_mask[:, 1:].any(axis=1).all()  # no row without targets
    # the short examples share a row: greedy packing
    assert len(rows_ids) < sum(-(-len(i) // 16) for i, _ in examples)
    # the long example's tokens come back in order
    ids, mask = examples[0]
    kept = np.concatenate([r[1:][m[1:]] for r, m in zip(rows_ids, rows_mask, strict=True)])
    assert kept[: int(mask[1:].sum())].tolist() == ids[1:][mask[1:]].tolist()


def test_bad_records_are_refused_with_their_line(tmp_path, ckpt):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"prompt": "no completion"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        TokenCorpus.load(path, ckpt)
    path.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        TokenCorpus.load(path, ckpt)
    with pytest.raises(FileNotFoundError):
        TokenCorpus.load(tmp_path / "missing.jsonl", ckpt)


def test_loss_sum_ignores_masked_targets(ckpt):
    last = HFStageModel(ckpt, 3, 4, dtype=torch.float32)
    logits = torch.randn(2, 5, last.vocab_size)
    targets = torch.randint(0, last.vocab_size, (2, 5))
    targets[0, :3] = IGNORE_INDEX
    keep = targets != IGNORE_INDEX
    expected = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
    torch.testing.assert_close(last.loss_sum(logits, targets), expected)


def test_a_fixed_training_set_of_records_is_its_rows(tmp_path, ckpt):
    corpus = TokenCorpus.load(write_jsonl(tmp_path / "qa.jsonl", PAIRS), ckpt)
    rows = corpus._data("train", 48)[0].shape[0]
    a = corpus.samples(seed=0, ids=[0, 1, rows], context=48)
    assert a[0].shape == (3, 48) and torch.equal(a[0][0], a[0][2]) and not torch.equal(a[0][0], a[0][1])
    assert torch.equal(corpus.samples(seed=5, ids=[1], context=48)[1][0], a[1][1])  # rows do not depend on the seed


def test_the_default_data_is_the_standard_librarys_source_for_a_checkpoint_too(ckpt):
    """``ravn local --model CKPT`` without ``--data`` trains on 'stdlib', as the built-in GPT does (a peer read
    'stdlib' as a path and failed the run before)."""
    corpus = TokenCorpus.load("stdlib", ckpt, cap_bytes=64 * 1024)
    ids, targets = corpus.batch(split="train", seed=0, step=0, index=0, batch_size=2, context=32)
    assert ids.shape == targets.shape == (2, 32) and corpus.layout == "stream"
