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
# The one place the run's wire codecs default; ``ravn plan`` reads the same: by the model's width and origin, the
# pair with the fewest bytes, among the codecs that origin may send, whose validation loss stays within 2% of fp32
# over 600 steps of gpt-medium (3 seeds, sync, AVX2 machine; docs/codecs.md, "600 steps"): 300 steps hid a cost
# that compounds. Against fp32 at step 600:
#   lowrank/ecsq   +1.58% (sd 0.24), 17.7x fewer bytes, gap growing ~0.14 points per 100 steps
#   int4_rot/ecsq  +1.13% (sd 0.65), 10.9x, ~0.13 points per 100 steps
#   int3_rot/ecsq  +5.80% (sd 0.52), 15.6x, ~0.9 points per 100 steps: the default until 2026-12-06; its 3-bit
#                  activations carry it (int3_rot/fp32 +4.91%, seed 0)
# A wide model trained from scratch (the built-in presets: gpt-medium) sends its activations lowrank, as rank-32
# factors: its hidden states are nearly rank 32 (docs/codecs.md, "Low rank"). A checkpoint's are not known to be, and
# lowrank loses whatever lies outside its directions, so wide checkpoints send int4_rot activations. Gradients go
# ecsq (one step per tensor, error feedback on, entropy-coded by rows). With --wire-zstd off ecsq cannot be sent
# and the default is int4_rot/int4_rot (+1.07%, -0.08%, -0.55% in three 3-seed sets at 300 steps, 7.3x plain; not
# run to 600). At width 128 (gpt-small, ravn local's default model) 4-bit activations cost +2.4-3.2% (3 x 300 steps),
# so narrow models send int8/int8.
DEFAULT_WIRE_WIDE = ("int4_rot", "ecsq")
DEFAULT_WIRE_SCRATCH = ("lowrank", "ecsq")
DEFAULT_WIRE_WIDE_PLAIN = ("int4_rot", "int4_rot")
DEFAULT_WIRE_NARROW = ("int8", "int8")


def default_wire(d_model: int, zstd: bool = True, from_scratch: bool = False) -> tuple[str, str]:
    """(forward, backward) codecs of a run that names none, for a model ``d_model`` wide.

    ``zstd``: whether the run codes 3- and 4-bit payloads (zstd) and ecsq's (by rows) losslessly
    (``--wire-zstd``); int3_rot and ecsq pay only so. ``from_scratch``: a built-in preset trained from its
    initialisation, not a checkpoint, whose hidden states are measured to be nearly low rank.
    """
    if d_model < WIDE_FROM:
        return DEFAULT_WIRE_NARROW
    if not zstd:
        return DEFAULT_WIRE_WIDE_PLAIN
    return DEFAULT_WIRE_SCRATCH if from_scratch else DEFAULT_WIRE_WIDE


def default_help(direction: int) -> str:
    """The default of ``--wire-forward`` (``direction`` 0) or ``--wire-backward`` (1), as help text."""
    return (
        f"default: {DEFAULT_WIRE_SCRATCH[direction]} for built-in models {WIDE_FROM} or more wide (gpt-medium), "
        f"{DEFAULT_WIRE_WIDE[direction]} for checkpoints "
        f"{WIDE_FROM} or more wide ({DEFAULT_WIRE_WIDE_PLAIN[direction]} for both with --wire-zstd off), "
        f"{DEFAULT_WIRE_NARROW[direction]} for narrower models"
    )
