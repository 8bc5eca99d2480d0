"""The embedded corpus is deterministic and needs no download."""

import pytest
import torch

from swarm.train.data import Corpus, epoch_samples


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


def test_a_fixed_training_set_is_seen_once_per_epoch_in_a_fresh_order() -> None:
    n = 10
    run = epoch_samples(3, n, 0, 3 * n)
    epochs = [run[i * n : (i + 1) * n] for i in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs) and epochs[0] != epochs[1]
    assert epoch_samples(3, n, 8, 4) == run[8:12]  # a micro-batch straddling two epochs
    assert epoch_samples(3, n, 0, n) == epochs[0] and epoch_samples(4, n, 0, n) != epochs[0]
    with pytest.raises(ValueError, match="at least one"):
        epoch_samples(0, 0, 0, 1)


def test_a_sample_is_the_same_sequence_at_every_visit(corpus: Corpus) -> None:
    x, y = corpus.samples(seed=1, ids=[5, 9, 5], context=32)
    assert x.shape == y.shape == (3, 32) and torch.equal(x[0], x[2]) and not torch.equal(x[0], x[1])
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(corpus.samples(seed=2, ids=[5], context=32)[0][0], x[0])
