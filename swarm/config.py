"""Typed configuration shared by every process of a run.

One object per concern instead of keyword arguments threaded through constructors: the coordinator
builds these once and sends them to every peer in its assignment, so all peers agree on the model
and the training recipe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# 2: calls signed with the caller's record key; 3: assignments carry only the sealed plan; 4: HFConfig.quant;
# 5: the plan names each link's codecs (Plan.links) and TrainConfig can leave them to it (wire_*_auto)
# 6: a stale backward uses the weights its forward saw (no weight_stashing flag, no recompute)
# 7: 4-bit payloads may travel zstd-coded (Tensor.compression, TrainConfig.wire_zstd)
# 8: codec INT3_ROT (a peer of 7 would refuse its packets mid-run instead of at Hello)
# 9: the scales of zstd-coded tensors may travel coded too (Tensor.scales_compression), as byte planes
# 10: codec LOWRANK (Tensor.rank, TrainConfig.wire_rank); error feedback 'auto' decided per link
# 11: codec ECSQ (one step per tensor, zstd-coded int8 codes)
# 12: ECSQ codes travel entropy-coded by rows (Compression ROWS) instead of zstd-coded
# 13: TrainConfig.lr_decay_steps (a peer of 12 would ignore it and train at a constant lr beside decaying ones)
# 14: activation deltas against each link's cached rows (Activations.cache, MicroBatch.samples; --wire-forward-delta)
PROTOCOL_VERSION = 14
SCHEDULES = ("sync", "async")
# Codecs of activation deltas (--wire-forward-delta): blockwise ones, whose scales follow the change itself, or
# ecsq, whose step follows the activation, so a small change costs few bits (swarm/wire/ecsq.py)
DELTA_CODECS = ("bf16", "int8", "int4", "int4_rot", "int3_rot", "ecsq")
DEFAULT_WIRE_RANK = 32  # columns of each factor of the ``lowrank`` codec (``--wire-rank``)

# ``--wire-forward auto`` / ``--wire-backward auto``: the coordinator picks each link's codec from a ladder,
# least per-message error first (coordinator/wire_choice.py). Since gradients carry fp32 block scales
# (3 seeds x 300 steps of gpt-medium, docs/codecs.md, "Which pair is the default"): int4_rot/int4_rot
# +1.07% / -0.08% (two sets), int4_rot/int8 +0.25%, int8/int8 +1.11%, bf16/bf16 +2.15%, within each
# other's spread; int4_rot is on both ladders (its gradients cost 6-8% before that fix). Plain int4
# (6-8% before the fix, not re-measured) is on neither.
# On models narrower than WIDE_FROM (gpt-small, width 128) 4-bit activations cost +2.4-3.2% (3 seeds), so
# auto's activation ladder stops at int8 there; 4-bit gradients behind int8 activations stayed within 2%.
# int3_rot/int3_rot (+0.48%, 3 seeds, gpt-medium) pays only zstd-coded and was measured only on wide models,
# so it ends both ladders of a wide model whose codes travel zstd-coded (``forward_ladder``, ``backward_ladder``).
# Over 600 steps int3_rot activations cost +4.9% (gpt-medium, seed 0; docs/codecs.md, "600 steps"): the last rung
# trades loss for a link nothing else fits.
WIRE_AUTO = "auto"
AUTO_FORWARD_LADDER = ("bf16", "int8", "int4_rot")
AUTO_BACKWARD_LADDER = ("bf16", "int8", "int4_rot")
NARROW_FORWARD_LADDER = ("bf16", "int8")
CODED_RUNG = "int3_rot"  # the rung below int4_rot where zstd codes the codes
# The default recipe: half the lr the runs of docs/ used until 2026-12-05 and each stage's gradient norm
# clipped at 1.0. On 300 steps of gpt-medium (3 seeds, sync) it ends 12% below 3e-3 unclipped, on gpt-small
# 4% below (docs/BENCHMARKS.md, "The default recipe").
DEFAULT_LR = 1.5e-3
DEFAULT_GRAD_CLIP = 1.0
# Async's bound and the micro-batches per step of a run that names none: ravn local, serve and ravn plan read these
# (and ``default_schedule``, ``default_max_in_flight``), so a plan sizes the run the same flags start.
DEFAULT_MAX_STALENESS = 1
DEFAULT_MICRO_BATCHES = 4
LR_DECAYS = ("constant", "cosine")
LR_DECAY_FLOOR = 0.1  # --lr-decay cosine ends at a tenth of the peak, as GPT-3's and Chinchilla's recipes do
WIDE_FROM = 256  # d_model from which 4-bit activations stay within 2% of fp32 (docs/codecs.md)


def default_schedule(*, from_scratch: bool) -> str:
    """The schedule of a run that names none, measured per origin as the wire codecs are (docs/BENCHMARKS.md,
    "Async the default"). A checkpoint's LoRA fine-tuning runs async, capped at K in flight: +0.00% against sync at
    the default recipe ("The lateness cap in LoRA fine-tuning"), 1.32-1.36x its speed with a core per peer. From
    scratch async stays within 2% of sync under the cosine decay (+1.41% over 600 steps of gpt-medium); at the
    constant lr, since the in-flight cap dropped the lateness cap, +1.91% on the mean of 4 seeds but two of them over
    2% ("The lateness cap in LoRA fine-tuning"), and the decay is no recipe for every run (it ended gpt-small's
    default 300 steps 1.0% higher in sync), so sync stays."""
    return "sync" if from_scratch else "async"


def default_max_in_flight(schedule: str, micro_batches: int) -> int:
    """The in-flight cap of a run that names none: under async K, sync's activation memory, which also cost less
    loss than the full (S + 1) x K window; under sync, nothing to cap (0)."""
    return micro_batches if schedule == "async" else 0


def forward_ladder(d_model: int, *, zstd: bool) -> tuple[str, ...]:
    """The activation codecs auto may pick for a model ``d_model`` wide, least lossy first."""
    if d_model < WIDE_FROM:
        return NARROW_FORWARD_LADDER
    return (*AUTO_FORWARD_LADDER, CODED_RUNG) if zstd else AUTO_FORWARD_LADDER


def backward_ladder(d_model: int, *, zstd: bool) -> tuple[str, ...]:
    """The gradient codecs auto may pick for a model ``d_model`` wide, least lossy first."""
    return (*AUTO_BACKWARD_LADDER, CODED_RUNG) if zstd and d_model >= WIDE_FROM else AUTO_BACKWARD_LADDER


def planned_codec(choice: str, ladder: tuple[str, ...]) -> str:
    """The codec the planner sizes a boundary with: ``choice`` itself, or for ``auto`` the ladder's smallest.

    Placement runs before the links are known, so under auto it assumes every link may fall back to the
    smallest codec; each link then gets a bigger one only where its measured bandwidth allows.
    """
    return ladder[-1] if choice == WIRE_AUTO else choice


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only GPT; byte-level vocabulary by default."""

    n_layers: int = 6
    d_model: int = 128
    n_heads: int = 4
    vocab_size: int = 256
    context: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.n_layers, self.d_model, self.n_heads, self.vocab_size, self.context) <= 0:
            raise ValueError(f"model dimensions must be positive: {self}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


BASE_QUANTS = ("none", "int8", "nf4")


@dataclass(frozen=True)
class HFConfig:
    """A local Hugging Face checkpoint fine-tuned with LoRA over a frozen (optionally int8 or NF4) base.

    ``quant`` is how the frozen base is stored in memory (``none``: in ``dtype``; ``int8``: per-channel
    absmax; ``nf4``: QLoRA's blockwise 4-bit NormalFloat); matmuls always run in ``dtype``.
    ``activation_checkpointing`` keeps only each layer's input per micro-batch in flight and recomputes
    the rest in the backward pass.
    """

    path: str
    dtype: str = "bf16"
    quant: str = "none"
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ()
    config_sha256: str = ""
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"unknown dtype {self.dtype!r}; choose bf16, fp16 or fp32")
        if self.quant not in BASE_QUANTS:
            raise ValueError(f"unknown base quantisation {self.quant!r}; choose {', '.join(BASE_QUANTS)}")
        if self.lora_rank <= 0:
            raise ValueError("LoRA fine-tuning needs --lora-rank of at least 1")


MODEL_PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": ModelConfig(n_layers=3, d_model=64, n_heads=2, context=64),
    "gpt-small": ModelConfig(n_layers=6, d_model=128, n_heads=4, context=128),
    "gpt-medium": ModelConfig(n_layers=6, d_model=256, n_heads=8, context=128),
}


@dataclass(frozen=True)
class TrainConfig:
    """The training recipe; every stage applies the same one to its own parameters."""

    steps: int = 300
    micro_batches: int = DEFAULT_MICRO_BATCHES
    micro_batch_size: int = 4
    lr: float = DEFAULT_LR
    weight_decay: float = 0.01
    warmup_steps: int = 20
    lr_decay_steps: int = 0  # cosine decay of the lr after the warm-up, to LR_DECAY_FLOOR at this step; 0: constant
    sync_steps: int = 60  # async: the first steps run synchronously (the warm-up at least; see admission.py)
    grad_clip: float = 0.0  # per stage; off here, as in torch's optimisers: the CLI's default is DEFAULT_GRAD_CLIP
    data: str = "stdlib"
    data_seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    schedule: str = "sync"
    max_staleness: int = 0
    max_in_flight: int = 0
    checkpoint_every: int = 0
    wire_forward: str = "fp32"
    wire_backward: str = "fp32"
    error_feedback_backward: str = "off"  # on, off or auto: carry a lossy gradient codec's residual, per link
    wire_zstd: bool = True  # 3- and 4-bit codes travel zstd-coded: lossless, fewer bytes (swarm/wire/entropy.py)
    wire_rank: int = DEFAULT_WIRE_RANK  # columns of each factor of the ``lowrank`` codec (swarm/wire/lowrank.py)
    average_every: int = 10  # T: replicas of a block average their parameter change every T local steps
    average_codec: str = "int8"
    outer_lr: float = 1.0  # DiLoCo outer step on the averaged change; 1 with no momentum is plain averaging
    outer_momentum: float = 0.0  # Nesterov momentum of the outer step
    average_timeout: float = 30.0  # seconds a round's leader waits for the other replicas
    train_samples: int = 0  # a fixed set of this many training sequences, seen epoch after epoch; 0: fresh windows
    wire_forward_delta: str = ""  # activations of a cached sample travel as a change in this codec ("": never)
    delta_cache_bytes: int = 1 << 30  # cached rows each side of a link holds in memory (swarm/wire/sample_store.py)
    delta_spill_bytes: int = 0  # and beyond those, in a file on disk
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.micro_batches <= 0 or self.micro_batch_size <= 0 or self.steps < 0:
            raise ValueError(f"steps, micro_batches and micro_batch_size must be positive: {self}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; available: {', '.join(SCHEDULES)}")
        if self.lr_decay_steps < 0:
            raise ValueError(f"lr_decay_steps must not be negative, got {self.lr_decay_steps}")
        if self.max_staleness < 0 or self.max_in_flight < 0 or self.sync_steps < 0:
            raise ValueError("max_staleness, max_in_flight and sync_steps must not be negative")
        if self.average_every <= 0 or self.average_timeout <= 0 or self.outer_lr <= 0:
            raise ValueError("average_every, average_timeout and outer_lr must be positive")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.train_samples < 0 or self.delta_cache_bytes < 0 or self.delta_spill_bytes < 0:
            raise ValueError("train_samples, delta_cache_bytes and delta_spill_bytes must not be negative")
        if self.wire_forward_delta and self.wire_forward_delta not in DELTA_CODECS:
            known = ", ".join(DELTA_CODECS)
            raise ValueError(f"unknown delta codec {self.wire_forward_delta!r}; choose one of: {known}")
        if self.wire_forward_delta and not self.train_samples:
            raise ValueError("activation deltas need samples that return: set train_samples (--train-samples N)")
        if self.schedule == "sync" and self.max_staleness:
            raise ValueError("the sync schedule has no staleness: use --schedule async with --max-staleness")

    @property
    def staleness_bound(self) -> int:
        """S: how many weight versions late a gradient may be applied (0 for sync)."""
        return 0 if self.schedule == "sync" else self.max_staleness

    @property
    def async_from(self) -> int:
        """The first step whose gradients may come back late: the warm-up and ``sync_steps`` run sync."""
        return max(self.warmup_steps, self.sync_steps)

    @property
    def in_flight_limit(self) -> int:
        """Micro-batches admitted but not yet back; bounds every stage's activation memory."""
        return self.max_in_flight or (self.staleness_bound + 1) * self.micro_batches

    @property
    def shrinks_late_steps(self) -> bool:
        """Whether a step's lr is capped by its gradients' lateness (``stage_runner.staleness_lr_scale``). That cap
        halved async's cost on gpt-small's full window, but under the in-flight cap at K (async's default) it cost
        loss at the constant lr: without it 300 steps of LoRA fine-tuning ended lower on every seed (at sync's loss)
        and 600 of gpt-medium from scratch on three seeds of four, the fourth a tie (docs/BENCHMARKS.md, "The
        lateness cap in LoRA fine-tuning"). The full window keeps it, and so does the cosine decay, measured only
        with it."""
        return self.in_flight_limit > self.micro_batches or self.lr_decay_steps > 0

    def lr_at(self, step: int) -> float:
        """Linear warm-up (short runs must still learn, long ones must not diverge), then constant, or a cosine
        decay to ``LR_DECAY_FLOOR`` of the peak at step ``lr_decay_steps`` (held there after it)."""
        warm = 1.0 if self.warmup_steps <= 0 else min(1.0, (step + 1) / self.warmup_steps)
        if self.lr_decay_steps <= 0:
            return self.lr * warm
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / max(1, self.lr_decay_steps - self.warmup_steps)))
        return self.lr * warm * (LR_DECAY_FLOOR + (1.0 - LR_DECAY_FLOOR) * 0.5 * (1.0 + math.cos(math.pi * progress)))
