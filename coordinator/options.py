"""Training options shared by ``ravn local`` and ``ravn-coordinator serve``, declared once.

``with_train_options`` adds these typer options to a command and hands the command one typed
``RunOptions`` instead of a dozen keyword arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from coordinator.option_checks import check_choice, check_model, check_name, config_error
from coordinator.train_data_options import TRAIN_DATA_PARAMS, TrainDataOptions, train_data_options
from coordinator.wire_defaults import (
    NEEDS_FEEDBACK,
    NEEDS_ZSTD,
    PLAIN_SIZE_OF,
    WIRE_CHOICES,
    default_help,
    default_wire,
)
from swarm.config import (
    BASE_QUANTS,
    DEFAULT_GRAD_CLIP,
    DEFAULT_LR,
    DEFAULT_MAX_STALENESS,
    DEFAULT_MICRO_BATCHES,
    LR_DECAYS,
    MODEL_PRESETS,
    SCHEDULES,
    HFConfig,
    ModelConfig,
    TrainConfig,
    default_max_in_flight,
    default_schedule,
)
from swarm.wire.codec_policy import FEEDBACK_MODES

AVERAGE_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "int4_rot")  # replica averaging sends nothing zstd-coded
ON_OFF = ("on", "off")


@dataclass(frozen=True)
class RunOptions:
    model: str
    steps: int
    micro_batches: int
    micro_batch_size: int
    lr: float
    data: str
    seed: int
    eval_every: int
    eval_batches: int
    wire_forward: str | None  # None: default_wire(the model's width)
    wire_backward: str | None
    error_feedback_backward: str  # on, off, auto (on for the links whose gradient codec is in FEEDBACK_AUTO_CODECS)
    wire_zstd: bool
    wire_rank: int
    schedule: str
    max_staleness: int
    max_in_flight: int
    grad_clip: float
    checkpoint_every: int
    finetune: str
    lora_rank: int
    lora_alpha: float
    lora_targets: str
    dtype: str
    quant: str
    activation_checkpointing: bool
    context: int
    name: str
    runs_dir: Path
    stages: int = 0
    replicate: int = -1
    average_every: int = 10
    average_codec: str = "int8"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    warmup_steps: int = 20
    sync_steps: int = 60
    lr_decay: str = "constant"
    train_data: TrainDataOptions = TrainDataOptions()

    @property
    def is_checkpoint(self) -> bool:
        return self.model not in MODEL_PRESETS

    def model_config(self) -> ModelConfig:
        """The model's sizes; a checkpoint's default context is 512, or its positions if fewer."""
        if self.is_checkpoint:
            from swarm.train.hf import hf_model_config
            from swarm.train.hf.checkpoint_check import default_context

            context = self.context or default_context(self.model)
            return ModelConfig(**{**hf_model_config(self.model, context).__dict__, "seed": self.seed})
        cfg = MODEL_PRESETS[self.model]
        return ModelConfig(**{**cfg.__dict__, "seed": self.seed, "context": self.context or cfg.context})

    def hf_config(self) -> HFConfig | None:
        """Set when ``--model`` is a Hugging Face checkpoint directory (LoRA over a frozen base)."""
        if not self.is_checkpoint:
            if self.finetune == "lora":
                raise typer.BadParameter(
                    "LoRA fine-tuning needs a Hugging Face checkpoint directory as --model", param_hint="--finetune"
                )
            return None
        if self.finetune == "full":
            raise typer.BadParameter(
                "a Hugging Face checkpoint is fine-tuned with --finetune lora (full fine-tuning "
                "of a frozen base is not supported)",
                param_hint="--finetune",
            )
        from swarm.train.stage_factory import config_sha256

        return HFConfig(
            path=str(Path(self.model).expanduser().resolve()),
            dtype=self.dtype,
            quant=self.quant,
            activation_checkpointing=self.activation_checkpointing,
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_targets=self.lora_target_names,
            config_sha256=config_sha256(self.model),
        )

    @property
    def lora_target_names(self) -> tuple[str, ...]:
        return tuple(t for t in self.lora_targets.replace(",", " ").split() if t)

    @property
    def model_name(self) -> str:
        return f"hf:{Path(self.model).name}"[:128] if self.is_checkpoint else self.model

    def wire(self) -> tuple[str, str]:
        """The run's (forward, backward) codecs: those given, else the default for the model's width and origin."""
        if self.wire_forward is not None and self.wire_backward is not None:
            return self.wire_forward, self.wire_backward
        fwd, bwd = default_wire(self.model_config().d_model, self.wire_zstd, from_scratch=not self.is_checkpoint)
        return self.wire_forward or fwd, self.wire_backward or bwd

    def train_config(self) -> TrainConfig:
        wire_forward, wire_backward = self.wire()
        for codec in {wire_forward, wire_backward} & NEEDS_ZSTD:
            if not self.wire_zstd:
                plain = PLAIN_SIZE_OF[codec]
                config_error(
                    f"codec {codec} pays only entropy-coded (plain, it is {plain}'s size); drop --wire-zstd off"
                )
        if wire_backward in NEEDS_FEEDBACK and self.error_feedback_backward == "off":
            config_error(
                f"gradients sent {wire_backward} need error feedback (without it gpt-medium trained 12% worse); "
                "drop --error-feedback-backward off, or name another --wire-backward"
            )
        return TrainConfig(
            steps=self.steps,
            micro_batches=self.micro_batches,
            micro_batch_size=self.micro_batch_size,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            lr_decay_steps=self.steps if self.lr_decay == "cosine" else 0,
            sync_steps=self.sync_steps,
            data=self.data,
            data_seed=self.seed,
            eval_every=self.eval_every,
            eval_batches=self.eval_batches,
            wire_forward=wire_forward,
            wire_backward=wire_backward,
            error_feedback_backward=self.error_feedback_backward,
            wire_zstd=self.wire_zstd,
            wire_rank=self.wire_rank,
            schedule=self.schedule,
            max_staleness=self.max_staleness,
            max_in_flight=self.max_in_flight,
            grad_clip=self.grad_clip,
            checkpoint_every=self.checkpoint_every,
            average_every=self.average_every,
            average_codec=self.average_codec,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            **self.train_data.train_config_fields(),
        )

    def run_name(self) -> str:
        return self.name or datetime.now().strftime("run-%Y%m%d-%H%M%S")


def checked_configs(options: RunOptions) -> tuple[ModelConfig, HFConfig | None]:
    """The run's model and checkpoint configs, after the checkpoint preflight (``checkpoint_check.py``).

    Called before anything starts (DHT, peers, a saved run forgotten): a checkpoint that cannot be
    trained, or options it cannot take (a context beyond its positions), end the command with one line.
    """
    try:
        if options.is_checkpoint:
            from swarm.train.hf.checkpoint_check import check_checkpoint, check_lora_targets

            check_checkpoint(options.model)
            check_lora_targets(options.model, options.lora_target_names)
        return options.model_config(), options.hf_config()
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError; typer.BadParameter passes through
        config_error(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def _train_params(
    model: Annotated[
        str,
        typer.Option(
            help=f"Model preset ({', '.join(MODEL_PRESETS)}) or a local Hugging Face checkpoint directory.",
            callback=check_model,
        ),
    ] = "gpt-small",
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps to train.")] = 300,
    micro_batches: Annotated[
        int, typer.Option(min=1, help="Micro-batches per optimizer step.")
    ] = DEFAULT_MICRO_BATCHES,
    micro_batch_size: Annotated[int, typer.Option(min=1, help="Sequences per micro-batch.")] = 4,
    lr: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Peak AdamW learning rate. The default, 1.5e-3 with --grad-clip 1, ended 12% (gpt-medium) and 4% "
            "(gpt-small) below 3e-3 unclipped over 300 steps (docs/BENCHMARKS.md).",
        ),
    ] = DEFAULT_LR,
    warmup_steps: Annotated[
        int,
        typer.Option(min=0, help="Steps of linear lr warm-up; the async schedule runs them synchronously."),
    ] = 20,
    lr_decay: Annotated[
        str,
        typer.Option(
            help="The lr after the warm-up: 'constant', or 'cosine' to a tenth of the peak at the last step. In sync "
            "the decay ended 1.4% lower over 600 steps of gpt-medium, but 1.0% higher over gpt-small's default 300 "
            "and 2.9% higher in LoRA fine-tuning; it holds async's cost from scratch at +1.4% instead of +2.5% "
            "(docs/BENCHMARKS.md, 'Async the default').",
            callback=lambda v: check_choice(v, LR_DECAYS, "lr decay"),
        ),
    ] = "constant",
    data: Annotated[
        str, typer.Option(help="'stdlib' (the Python standard library's source) or a text file/folder.")
    ] = "stdlib",
    seed: Annotated[int, typer.Option(help="Seed of the model initialisation and of the data order.")] = 0,
    eval_every: Annotated[int, typer.Option(min=0, help="Steps between validation passes (0: only at the end).")] = 50,
    eval_batches: Annotated[int, typer.Option(min=1, help="Micro-batches per validation pass.")] = 8,
    wire_forward: Annotated[
        str | None,
        typer.Option(
            help=f"Codec for activations: {', '.join(WIRE_CHOICES)} (auto: per link, from its measured bandwidth; "
            f"{default_help(0)}).",
            callback=lambda v: v if v is None else check_choice(v, WIRE_CHOICES, "codec"),
            show_default=False,
        ),
    ] = None,
    wire_backward: Annotated[
        str | None,
        typer.Option(
            help=f"Codec for gradients: {', '.join(WIRE_CHOICES)} (auto: per link, from its measured bandwidth; "
            f"{default_help(1)}).",
            callback=lambda v: v if v is None else check_choice(v, WIRE_CHOICES, "codec"),
            show_default=False,
        ),
    ] = None,
    error_feedback_backward: Annotated[
        str,
        typer.Option(
            help="'on': a lossy gradient codec's rounding error is added to the next gradient sent to the same "
            "peer (error feedback); 'off': every gradient is quantised on its own; 'auto': on for gradients sent "
            "ecsq (the default from width 256, which needs it), int3_rot (with --wire-backward auto, on the links "
            "that pick it; at the default recipe error feedback took its loss cost on gpt-medium from +3.2% to "
            "+2.0%, docs/BENCHMARKS.md) or lowrank, off otherwise (no measured gain).",
            callback=lambda v: check_choice(v, FEEDBACK_MODES, "setting"),
        ),
    ] = "auto",
    wire_zstd: Annotated[
        str,
        typer.Option(
            help="'on': 3- and 4-bit codes (int4, int4_rot, int3_rot) travel zstd-coded and ecsq's entropy-coded "
            "by rows, losslessly: on gpt-medium 348-375 instead of 570 bytes per token (int4_rot), for ~0.2 ms "
            "per micro-batch tensor (docs/codecs.md); 'off': as the codec makes them (int3_rot and ecsq need 'on', "
            "so the default from width 256 is then int4_rot).",
            callback=lambda v: check_choice(v, ON_OFF, "setting"),
        ),
    ] = "on",
    wire_rank: Annotated[
        int,
        typer.Option(
            min=1,
            max=4096,
            help="Columns of each factor of the lowrank codec (--wire-forward/--wire-backward lowrank): each "
            "micro-batch tensor travels as (tokens + width) x rank int8 values, for models whose boundary "
            "tensors hold their energy in few directions (benchmarks/entropy.py measures it; docs/codecs.md).",
        ),
    ] = 32,
    schedule: Annotated[
        str | None,
        typer.Option(
            help="'async' (bounded staleness: fills the pipeline's bubbles; the default for a checkpoint's LoRA "
            "fine-tuning, S = 1 with --micro-batches in flight: +0.00% against sync, 1.32-1.36x its tokens/s at 10-50 "
            "Mbit/s with a core per peer) or 'sync' (GPipe, the exact reference; the default from scratch, where async "
            "costs +1.9% at the constant lr (two seeds of four over 2%) and +1.4% with --lr-decay cosine over 600 "
            "steps of gpt-medium; docs/BENCHMARKS.md, 'Async the default').",
            callback=lambda v: v if v is None else check_choice(v, SCHEDULES, "schedule"),
            show_default=False,
        ),
    ] = None,
    max_staleness: Annotated[
        int, typer.Option(min=0, help="Async: apply no gradient more than S weight versions late; 0 is exactly sync.")
    ] = DEFAULT_MAX_STALENESS,
    sync_steps: Annotated[
        int,
        typer.Option(
            min=0,
            help="Async: run the first steps synchronously (the warm-up at least). Early on the weights move "
            "fastest and a late gradient costs most: starting async at step 60 instead of 20 cut its loss cost "
            "on gpt-small from +8.4% to +2.5% (docs/BENCHMARKS.md).",
        ),
    ] = 60,
    max_in_flight: Annotated[
        int | None,
        typer.Option(
            min=0,
            show_default=False,
            help="Async: micro-batches in the pipeline at once (default: --micro-batches, sync's activation memory; "
            "0: (S+1) x micro-batches, those that would come back 2+ versions late only while the measured pipeline "
            "needs them). The default cost less loss than 0 (+1.4% against +2.9% over 600 steps of gpt-medium, "
            "+0.00% against +1.3% in LoRA fine-tuning) at less speed on shared cores (docs/BENCHMARKS.md).",
        ),
    ] = None,
    grad_clip: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Clip each stage's gradient norm at this (0: off, the unsplit model's exact recipe). Per stage, "
            "so not identical to clipping the unsplit model; it also keeps stale gradients from spiking the loss.",
        ),
    ] = DEFAULT_GRAD_CLIP,
    checkpoint_every: Annotated[
        int,
        typer.Option(
            min=0,
            help="Every C steps each stage sends its weights and optimizer state to the coordinator, "
            "so a lost peer costs at most C steps (0: no checkpoints, no recovery).",
        ),
    ] = 25,
    finetune: Annotated[
        str,
        typer.Option(
            help="'full' (built-in GPT) or 'lora' (adapters over a frozen Hugging Face checkpoint; "
            "the default for checkpoints).",
            callback=lambda v: check_choice(v, ("", "full", "lora"), "finetune mode"),
        ),
    ] = "",
    lora_rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 16,
    lora_alpha: Annotated[float, typer.Option(min=0.0, help="LoRA alpha (scale = alpha / rank).")] = 32.0,
    lora_targets: Annotated[
        str,
        typer.Option(help="Comma-separated module names for adapters (default: every attention and MLP projection)."),
    ] = "",
    dtype: Annotated[
        str,
        typer.Option(
            help="Frozen base weights: bf16, fp16 or fp32.",
            callback=lambda v: check_choice(v, ("bf16", "fp16", "fp32"), "dtype"),
        ),
    ] = "bf16",
    quant: Annotated[
        str,
        typer.Option(
            help="Frozen base in memory: none (in --dtype), int8 (per-channel) or nf4 (QLoRA's 4-bit NormalFloat); "
            "dequantised per matmul.",
            callback=lambda v: check_choice(v, BASE_QUANTS, "quant"),
        ),
    ] = "none",
    activation_checkpointing: Annotated[
        bool,
        typer.Option(
            "--activation-checkpointing/--no-activation-checkpointing",
            help="Keep only each layer's input per micro-batch in flight; recompute the layer in the backward pass.",
        ),
    ] = False,
    context: Annotated[
        int,
        typer.Option(
            min=0, help="Tokens per sequence (0: the preset's; for checkpoints 512, or their positions if fewer)."
        ),
    ] = 0,
    name: Annotated[
        str, typer.Option(help="Run name; artefacts go to RUNS_DIR/NAME (default: a timestamp).", callback=check_name)
    ] = "",
    runs_dir: Annotated[Path, typer.Option(help="Folder that holds the runs.")] = Path("runs"),
    stages: Annotated[
        int,
        typer.Option(
            min=0,
            help="Pipeline stages (0: one per peer). With fewer stages than peers, the spare peers become "
            "replicas that share a block's micro-batches and average its parameters.",
        ),
    ] = 0,
    replicate: Annotated[
        int,
        typer.Option(
            min=-1,
            help="Stage that gets the spare peers as replicas (-1: the one the planner predicts slowest; "
            "the first stage, which holds the data, is never replicated).",
        ),
    ] = -1,
    average_every: Annotated[
        int, typer.Option(min=1, help="Replicas average their parameters every T local optimizer steps.")
    ] = 10,
    average_codec: Annotated[
        str,
        typer.Option(
            help=f"Codec of the averaged parameter changes: {', '.join(AVERAGE_CODECS)}.",
            callback=lambda v: check_choice(v, AVERAGE_CODECS, "codec"),
        ),
    ] = "int8",
    outer_lr: Annotated[
        float, typer.Option(min=0.0, help="Outer (DiLoCo) step on the averaged change; 1 is plain averaging.")
    ] = 1.0,
    outer_momentum: Annotated[
        float, typer.Option(min=0.0, max=0.99, help="Nesterov momentum of the outer step (0: none).")
    ] = 0.0,
) -> RunOptions:
    schedule = schedule or default_schedule(from_scratch=model in MODEL_PRESETS)
    return RunOptions(
        model,
        steps,
        micro_batches,
        micro_batch_size,
        lr,
        data,
        seed,
        eval_every,
        eval_batches,
        wire_forward,
        wire_backward,
        error_feedback_backward,
        wire_zstd == "on",
        wire_rank,
        schedule,
        max_staleness if schedule == "async" else 0,
        default_max_in_flight(schedule, micro_batches) if max_in_flight is None else max_in_flight,
        grad_clip,
        checkpoint_every,
        finetune or ("full" if model in MODEL_PRESETS else "lora"),
        lora_rank,
        lora_alpha,
        lora_targets,
        dtype,
        quant,
        activation_checkpointing,
        context,
        name,
        runs_dir,
        stages,
        replicate,
        average_every,
        average_codec,
        outer_lr,
        outer_momentum,
        warmup_steps,
        sync_steps,
        lr_decay,
    )


_TRAIN_PARAMS = list(inspect.signature(_train_params, eval_str=True).parameters.values())


def with_train_options(fn):
    """Give ``fn(options: RunOptions, ...)`` the shared training options as typer parameters."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "options"]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        train = {p.name: kwargs.pop(p.name) for p in _TRAIN_PARAMS}
        data = train_data_options(**{p.name: kwargs.pop(p.name) for p in TRAIN_DATA_PARAMS})
        return fn(options=dataclasses.replace(_train_params(**train), train_data=data), **kwargs)

    params = own + _TRAIN_PARAMS + TRAIN_DATA_PARAMS
    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
