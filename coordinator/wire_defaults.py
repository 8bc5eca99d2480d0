"""Which codecs a run sends with when it names none, and which it may name: one place for the command line,
``ravn plan`` and their help."""

from __future__ import annotations

from swarm.config import WIDE_FROM, WIRE_AUTO

WIRE_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "int4_rot", "int3_rot", "lowrank", "ecsq")
NEEDS_ZSTD = frozenset({"int3_rot", "ecsq"})  # plain, as large as int4_rot's (int8's) and coarser
# Without error feedback ecsq rounds a small token's whole gradient to 0 every time: gpt-medium trained 12% worse
# by step 180 (docs/codecs.md, "ecsq"), so a run that sends it must carry its residual.
NEEDS_FEEDBACK = frozenset({"ecsq"})
PLAIN_SIZE_OF = {"int3_rot": "int4_rot", "ecsq": "int8"}  # what a NEEDS_ZSTD codec sends without zstd
WIRE_CHOICES = (*WIRE_CODECS, WIRE_AUTO)  # auto: each link's codec from its measured bandwidth (wire_choice.py)
# The one place the run's wire codecs default; ``ravn plan`` reads the same: by the model's width, the pair
# with the fewest bytes whose validation loss stays within 2% of fp32 (3 seeds x 300 steps, docs/codecs.md,
# "Which pair is the default" and "int3_rot"). At width 256 (gpt-medium) int3_rot/int3_rot zstd-coded:
# +0.48% at 19.5x fewer bytes than fp32 (16.9x over the last third), the only pair to reach the
# time-to-target loss on all 3 seeds (docs/BENCHMARKS.md, section 3). With --wire-zstd off int3_rot would
# be int4_rot's size, so there the default stays int4_rot/int4_rot (+1.07%, -0.08% and -0.55% in three
# 3-seed sets, 7.3x plain). At width 128 (gpt-small, ravn local's default model) 4-bit activations cost
# +2.4% (int4_rot/int8) and +3.2% (int4_rot/int4_rot), int8/int8 -0.49% with a flat last third
# (int8/int4_rot +0.41%, but its gap grew). Wider models (every Hugging Face checkpoint) take the wide
# pair: measured at 256, not beyond. Those figures are the old recipe's (lr 3e-3, unclipped); at today's
# (lr 1.5e-3, clip 1) int3_rot/int3_rot costs +1.97% with error feedback on its gradients, at 14.8x, its gap
# growing (docs/BENCHMARKS.md, "The default recipe"), and lowrank forward / int3_rot backward +1.23% (docs/codecs.md,
# "Low rank"; opt-in: measured on gpt-medium only, whose hidden states are nearly rank 32). Since 2026-12-05 the
# wide default sends gradients ecsq (one step per tensor, error feedback on): +0.57% at the same bytes (5 seeds),
# every seed below int3_rot gradients' (+1.82%), its gap growing half as fast (docs/codecs.md, "ecsq").
DEFAULT_WIRE_WIDE = ("int3_rot", "ecsq")
DEFAULT_WIRE_WIDE_PLAIN = ("int4_rot", "int4_rot")
DEFAULT_WIRE_NARROW = ("int8", "int8")


def default_wire(d_model: int, zstd: bool = True) -> tuple[str, str]:
    """(forward, backward) codecs of a run that names none, for a model ``d_model`` wide.

    ``zstd``: whether the run codes 3- and 4-bit payloads (zstd) and ecsq's (by rows) losslessly
    (``--wire-zstd``); int3_rot and ecsq pay only so.
    """
    if d_model < WIDE_FROM:
        return DEFAULT_WIRE_NARROW
    return DEFAULT_WIRE_WIDE if zstd else DEFAULT_WIRE_WIDE_PLAIN


def default_help(direction: int) -> str:
    """The default of ``--wire-forward`` (``direction`` 0) or ``--wire-backward`` (1), as help text."""
    return (
        f"default: {DEFAULT_WIRE_WIDE[direction]} for models {WIDE_FROM} or more wide "
        f"({DEFAULT_WIRE_WIDE_PLAIN[direction]} with --wire-zstd off), "
        f"{DEFAULT_WIRE_NARROW[direction]} for narrower ones"
    )
