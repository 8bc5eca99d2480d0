"""Checks of option values shared by the commands' typer options: one ``BadParameter`` line each."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NoReturn

import typer

from swarm.config import MODEL_PRESETS


def check_model(value: str) -> str:
    if value in MODEL_PRESETS:
        return value
    if Path(value).expanduser().is_dir():  # the checkpoint preflight names what is wrong with it
        return value
    raise typer.BadParameter(
        f"{value!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a Hugging Face "
        "checkpoint directory (with config.json)"
    )


def check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    if value not in choices:
        raise typer.BadParameter(f"unknown {what} {value!r}; choose one of: {', '.join(choices)}")
    return value


def check_name(value: str) -> str:
    if value and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
        raise typer.BadParameter("use letters, digits, '.', '_' or '-' (at most 64 characters)")
    return value


def config_error(message: str, code: int = 2) -> NoReturn:
    """A configuration mistake: one ``error:`` line on stderr and a non-zero exit, never a traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
