"""The embedded corpus is deterministic and needs no download."""

import pytest
import torch

from swarm.train.data import Corpus


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.load()


def test_stdlib_corpus_is_deterministic(corpus: Corpus) -> None:
    assert corpus.digest == Corpus.load().digest
    assert len(corpus.train) > 1_000_000 and len(corpus.val) > 10_000


def test_batches_are_a_function_of_their_coordinates(corpus: Corpus) -> None:
    kw = dict(split="train", seed=1, step=5, index=2, batch_size=3, context=32)
    x1, y1 = corpus.batch(**kw)
    x2, y2 = corpus.batch(**kw)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    x3, _ = corpus.batch(**{**kw, "index": 3})
    assert not torch.equal(x1, x3)


def test_user_data_path(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("hello swarm " * 200)
    c = Corpus.load(str(tmp_path))
    assert len(c.train) > 1000 and bytes(c.train[:5].tolist()) == b"hello"
    with pytest.raises(FileNotFoundError):
        Corpus.load(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        Corpus.load(str(tmp_path / "empty"))
