"""The default wire codecs follow the model's width and origin: from width 256 rank-32 activations for a model
trained from scratch and 4-bit ones for a checkpoint, ecsq gradients; int8 on narrower models.

Measured (docs/codecs.md, "600 steps", "Which pair is the default" and "ecsq"): over 600 steps of gpt-medium
(width 256) lowrank/ecsq and int4_rot/ecsq stay within 2% of fp32, int3_rot/ecsq (the default before) does not;
at width 128 (gpt-small, ravn local's default model) 4-bit activations cost 2.4-3.2% and int8/int8 stays
within 2%. ``ravn local``,
``ravn-coordinator serve`` and ``ravn plan`` apply the same rule; a codec the user names is kept as given.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from coordinator.ravn_cli import app as ravn_app
from coordinator.wire_defaults import (
    DEFAULT_WIRE_NARROW,
    DEFAULT_WIRE_SCRATCH,
    DEFAULT_WIRE_WIDE,
    DEFAULT_WIRE_WIDE_PLAIN,
    default_wire,
)
from swarm.config import MODEL_PRESETS
from tests.recipe_cli import recipe, refused
from tests.test_plan_command import TINY


def chosen(*args: str) -> tuple[str, str]:
    """The (forward, backward) codecs a run started with ``args`` would train with."""
    train = recipe(*args)
    return train.wire_forward, train.wire_backward


def test_the_rule() -> None:
    assert default_wire(128) == DEFAULT_WIRE_NARROW == ("int8", "int8")
    assert default_wire(255) == DEFAULT_WIRE_NARROW
    assert default_wire(256) == DEFAULT_WIRE_WIDE == ("int4_rot", "ecsq")
    assert default_wire(8192) == DEFAULT_WIRE_WIDE
    # int3_rot and ecsq pay only zstd-coded: without it the wide default is int4_rot, and narrow models keep int8
    assert default_wire(256, zstd=False) == DEFAULT_WIRE_WIDE_PLAIN == ("int4_rot", "int4_rot")
    assert default_wire(128, zstd=False) == DEFAULT_WIRE_NARROW
    # a wide model trained from scratch (the built-in presets) sends its activations as rank-32 factors: over 600
    # steps of gpt-medium +1.58% against fp32 where int3_rot/ecsq cost +5.8%; a checkpoint's hidden states are not
    # known to be low rank, so checkpoints send a per-value codec (int4_rot, +1.13%), and every narrow model int8
    assert default_wire(256, from_scratch=True) == DEFAULT_WIRE_SCRATCH == ("lowrank", "ecsq")
    assert default_wire(128, from_scratch=True) == DEFAULT_WIRE_NARROW
    assert default_wire(256, zstd=False, from_scratch=True) == DEFAULT_WIRE_WIDE_PLAIN


def test_runs_take_the_default_of_their_model_and_keep_what_the_user_names() -> None:
    assert MODEL_PRESETS["gpt-small"].d_model == 128 and MODEL_PRESETS["gpt-medium"].d_model == 256
    assert chosen() == ("int8", "int8")  # gpt-small, ravn local's default model
    assert chosen("--model", "gpt-medium") == ("lowrank", "ecsq")  # the wide preset, trained from scratch
    assert chosen("--model", "gpt-medium", "--wire-zstd", "off") == ("int4_rot", "int4_rot")
    assert chosen("--wire-forward", "bf16") == ("bf16", "int8")
    assert chosen("--model", "gpt-medium", "--wire-backward", "int8") == ("lowrank", "int8")
    assert chosen("--model", "gpt-medium", "--wire-forward", "int3_rot") == ("int3_rot", "ecsq")
    assert chosen("--wire-forward", "auto", "--wire-backward", "fp32") == ("auto", "fp32")


def test_an_unknown_codec_is_still_refused() -> None:
    output = refused("--wire-forward", "int3")
    assert "unknown codec 'int3'" in output, output


def test_ravn_plan_takes_the_same_default(tmp_path: Path) -> None:
    peers = ["--peer", "4GiB,100mbit", "--peer", "4GiB,100mbit"]
    for hidden, pair in ((256, DEFAULT_WIRE_WIDE), (128, DEFAULT_WIRE_NARROW)):
        (tmp_path / "config.json").write_text(json.dumps({**TINY, "hidden_size": hidden}))
        result = CliRunner().invoke(ravn_app, ["plan", "--model", str(tmp_path), *peers, "--json"])
        assert result.exit_code == 0, result.output
        settings = json.loads(result.output)["settings"]
        assert (settings["wire_forward"], settings["wire_backward"]) == pair, settings


def test_a_wide_checkpoint_keeps_the_per_value_codec(tmp_path: Path) -> None:
    # lowrank is the default only where its low rank is measured: a checkpoint's hidden states are not known to be
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "hidden_size": 256}))
    assert chosen("--model", str(tmp_path)) == DEFAULT_WIRE_WIDE == ("int4_rot", "ecsq")
    assert chosen("--model", str(tmp_path), "--wire-zstd", "off") == DEFAULT_WIRE_WIDE_PLAIN
