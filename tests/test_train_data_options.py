"""A fixed training set and activation deltas as a user sets them, and their trip to the peers."""

import pytest

from swarm.config import TrainConfig
from swarm.messages import train_from_pb, train_to_pb
from tests.recipe_cli import recipe, refused


def test_the_flags_reach_the_recipe_and_the_peers() -> None:
    plain = recipe()
    assert (plain.train_samples, plain.wire_forward_delta) == (0, "")
    t = recipe("--train-samples", "2048", "--wire-forward-delta", "int3_rot", "--delta-spill-mib", "512")
    assert (t.train_samples, t.wire_forward_delta) == (2048, "int3_rot")
    assert (t.delta_cache_bytes, t.delta_spill_bytes) == (1024 << 20, 512 << 20)
    assert train_from_pb(train_to_pb(t), steps=t.steps) == t
    assert train_from_pb(train_to_pb(plain), steps=plain.steps) == plain


def test_deltas_without_returning_samples_or_with_an_unknown_codec_are_refused() -> None:
    assert "--train-samples" in refused("--wire-forward-delta", "int4_rot")
    output = refused("--train-samples", "8", "--wire-forward-delta", "lowrank")
    assert "int3_rot" in output and "off" in output
    with pytest.raises(ValueError, match="train_samples"):
        TrainConfig(wire_forward_delta="int8")
    with pytest.raises(ValueError, match="unknown delta codec"):
        TrainConfig(train_samples=8, wire_forward_delta="lowrank")
