"""Training options shared by ``ravn local`` and ``ravn-coordinator serve``, declared once.

``with_train_options`` adds these typer options to a command and hands the command one typed
``RunOptions`` instead of a dozen keyword arguments.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from swarm.config import MODEL_PRESETS, SCHEDULES, ModelConfig, TrainConfig

WIRE_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "int4_rot")


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
    wire_forward: str
    wire_backward: str
    schedule: str
    max_staleness: int
    weight_stashing: bool
    max_in_flight: int
    grad_clip: float | None
    name: str
    runs_dir: Path

    def model_config(self) -> ModelConfig:
        cfg = MODEL_PRESETS[self.model]
        return ModelConfig(**{**cfg.__dict__, "seed": self.seed})

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            steps=self.steps,
            micro_batches=self.micro_batches,
            micro_batch_size=self.micro_batch_size,
            lr=self.lr,
            data=self.data,
            data_seed=self.seed,
            eval_every=self.eval_every,
            eval_batches=self.eval_batches,
            wire_forward=self.wire_forward,
            wire_backward=self.wire_backward,
            schedule=self.schedule,
            max_staleness=self.max_staleness,
            weight_stashing=self.weight_stashing,
            max_in_flight=self.max_in_flight,
            grad_clip=self.grad_clip if self.grad_clip is not None else (1.0 if self.schedule == "async" else 0.0),
        )

    def run_name(self) -> str:
        return self.name or datetime.now().strftime("run-%Y%m%d-%H%M%S")


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    if value not in choices:
        raise typer.BadParameter(f"unknown {what} {value!r}; choose one of: {', '.join(choices)}")
    return value


def _check_name(value: str) -> str:
    if value and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
        raise typer.BadParameter("use letters, digits, '.', '_' or '-' (at most 64 characters)")
    return value


def _train_params(
    model: Annotated[
        str,
        typer.Option(
            help=f"Model preset: {', '.join(MODEL_PRESETS)}.",
            callback=lambda v: _check_choice(v, tuple(MODEL_PRESETS), "model"),
        ),
    ] = "gpt-small",
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps to train.")] = 300,
    micro_batches: Annotated[int, typer.Option(min=1, help="Micro-batches per optimizer step.")] = 4,
    micro_batch_size: Annotated[int, typer.Option(min=1, help="Sequences per micro-batch.")] = 4,
    lr: Annotated[float, typer.Option(min=0.0, help="Peak AdamW learning rate.")] = 3e-3,
    data: Annotated[
        str, typer.Option(help="'stdlib' (the Python standard library's source) or a text file/folder.")
    ] = "stdlib",
    seed: Annotated[int, typer.Option(help="Seed of the model initialisation and of the data order.")] = 0,
    eval_every: Annotated[int, typer.Option(min=0, help="Steps between validation passes (0: only at the end).")] = 50,
    eval_batches: Annotated[int, typer.Option(min=1, help="Micro-batches per validation pass.")] = 8,
    wire_forward: Annotated[
        str,
        typer.Option(
            help=f"Codec for activations: {', '.join(WIRE_CODECS)}.",
            callback=lambda v: _check_choice(v, WIRE_CODECS, "codec"),
        ),
    ] = "fp32",
    wire_backward: Annotated[
        str,
        typer.Option(
            help=f"Codec for gradients: {', '.join(WIRE_CODECS)}.",
            callback=lambda v: _check_choice(v, WIRE_CODECS, "codec"),
        ),
    ] = "fp32",
    schedule: Annotated[
        str,
        typer.Option(
            help="'sync' (GPipe: the exact reference) or 'async' (bounded staleness).",
            callback=lambda v: _check_choice(v, SCHEDULES, "schedule"),
        ),
    ] = "sync",
    max_staleness: Annotated[
        int, typer.Option(min=0, help="Async: apply no gradient more than S weight versions late; 0 is exactly sync.")
    ] = 1,
    weight_stashing: Annotated[
        bool,
        typer.Option(
            help="Async: backward with the weights the forward used "
            "(PipeDream); costs one weight copy per version in flight."
        ),
    ] = False,
    max_in_flight: Annotated[
        int, typer.Option(min=0, help="Micro-batches in the pipeline at once (0: (S+1) x micro-batches).")
    ] = 0,
    grad_clip: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Clip each stage's gradient norm (0: off; default: off for sync, 1.0 for async, where stale "
            "gradients can otherwise spike the loss). Per stage, so not identical to clipping the unsplit model.",
        ),
    ] = None,
    name: Annotated[
        str, typer.Option(help="Run name; artefacts go to RUNS_DIR/NAME (default: a timestamp).", callback=_check_name)
    ] = "",
    runs_dir: Annotated[Path, typer.Option(help="Folder that holds the runs.")] = Path("runs"),
) -> RunOptions:
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
        schedule,
        max_staleness if schedule == "async" else 0,
        weight_stashing,
        max_in_flight,
        grad_clip,
        name,
        runs_dir,
    )


_TRAIN_PARAMS = list(inspect.signature(_train_params, eval_str=True).parameters.values())


def with_train_options(fn):
    """Give ``fn(options: RunOptions, ...)`` the shared training options as typer parameters."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "options"]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        train = {p.name: kwargs.pop(p.name) for p in _TRAIN_PARAMS}
        return fn(options=_train_params(**train), **kwargs)

    params = own + _TRAIN_PARAMS
    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
