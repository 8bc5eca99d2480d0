"""The model splits exactly: blocks built alone equal the same layers of the whole model."""

import pytest
import torch

from swarm.config import ModelConfig
from swarm.train.model import StageModel, even_split, full_model

CFG = ModelConfig(n_layers=5, d_model=32, n_heads=4, context=16, seed=3)


def test_blocks_build_identically_to_the_whole_model() -> None:
    whole = full_model(CFG).state_dict()
    merged = {}
    for a, b in even_split(CFG.n_layers, 3):
        merged.update(StageModel(CFG, a, b).state_dict())
    assert merged.keys() == whole.keys()
    for k, v in whole.items():
        assert torch.equal(merged[k], v), k


def test_chained_blocks_compute_the_whole_forward() -> None:
    x = torch.randint(0, CFG.vocab_size, (2, CFG.context))
    h = x
    for a, b in even_split(CFG.n_layers, 3):
        h = StageModel(CFG, a, b)(h)
    torch.testing.assert_close(h, full_model(CFG)(x), rtol=0, atol=1e-6)


def test_seed_changes_the_weights() -> None:
    other = ModelConfig(**{**CFG.__dict__, "seed": 4})
    assert not torch.equal(full_model(CFG).layers["0"].attn.qkv.weight, full_model(other).layers["0"].attn.qkv.weight)


@pytest.mark.parametrize("n,s", [(6, 3), (5, 2), (7, 7), (3, 1)])
def test_even_split_is_contiguous_and_complete(n: int, s: int) -> None:
    bounds = even_split(n, s)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:], strict=False))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_bad_blocks_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="invalid block"):
        StageModel(CFG, 3, 3)
    with pytest.raises(ValueError, match="cannot split"):
        even_split(3, 4)
    with pytest.raises(ValueError, match="exceeds the context"):
        full_model(CFG)(torch.zeros(1, CFG.context + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, n_heads=4)
