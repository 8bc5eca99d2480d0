"""The recipe's optional cosine lr decay: its shape, its flag, and its trip to the peers.

That every peer applies it is shown by tests/test_pipeline_exact.py's ``sync-cosine`` case (3 real peers
against the unsplit model); here the schedule itself and the way a user sets it.
"""

import math

import pytest

from swarm.config import LR_DECAY_FLOOR, TrainConfig
from swarm.messages import train_from_pb, train_to_pb
from tests.recipe_cli import recipe, refused


def test_the_lr_is_constant_after_the_warm_up_unless_decay_is_asked_for() -> None:
    t = TrainConfig(lr=1e-3, warmup_steps=20)
    assert [t.lr_at(s) for s in (0, 9, 19, 20, 300, 10_000)] == [1e-3 * 1 / 20, 1e-3 * 10 / 20, 1e-3, 1e-3, 1e-3, 1e-3]


def test_cosine_decays_from_the_peak_after_the_warm_up_to_the_floor_at_its_last_step_and_stays_there() -> None:
    t = TrainConfig(lr=1e-3, warmup_steps=20, lr_decay_steps=620)
    assert t.lr_at(0) == 1e-3 / 20 and t.lr_at(19) == t.lr_at(20) == 1e-3  # the warm-up as before
    assert math.isclose(t.lr_at(320), 1e-3 * (LR_DECAY_FLOOR + (1 - LR_DECAY_FLOOR) / 2))  # half-way
    assert math.isclose(t.lr_at(620), 1e-3 * LR_DECAY_FLOOR) and t.lr_at(5_000) == t.lr_at(620)
    lrs = [t.lr_at(s) for s in range(19, 700)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)), "the decayed lr must never rise"


def test_a_warm_up_as_long_as_the_decay_does_not_divide_by_zero() -> None:
    t = TrainConfig(lr=1e-3, warmup_steps=10, lr_decay_steps=10)
    assert t.lr_at(9) == t.lr_at(10) == 1e-3 and math.isclose(t.lr_at(11), 1e-3 * LR_DECAY_FLOOR)


def test_the_flag_decays_over_the_runs_steps_and_the_recipe_carries_it_to_the_peers() -> None:
    assert recipe("--steps", "600").lr_decay_steps == 0
    cosine = recipe("--steps", "600", "--lr-decay", "cosine")
    assert cosine.lr_decay_steps == 600
    assert train_from_pb(train_to_pb(cosine)).lr_decay_steps == 600
    assert train_from_pb(train_to_pb(recipe())).lr_decay_steps == 0


def test_an_unknown_decay_is_refused_with_the_choices() -> None:
    output = refused("--lr-decay", "linear")
    assert "constant" in output and "cosine" in output
    with pytest.raises(ValueError, match="lr_decay_steps"):
        TrainConfig(lr_decay_steps=-1)
