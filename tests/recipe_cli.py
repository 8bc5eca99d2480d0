"""The recipe a user's command-line flags give, through the same options `ravn local` and `serve` take.

Tests of one flag call these instead of starting a swarm: the flags are parsed, checked and turned into a
``TrainConfig`` exactly as a run would, and a refused flag shows the user's error.
"""

from __future__ import annotations

import typer
from typer.testing import CliRunner, Result

from coordinator.options import RunOptions, with_train_options
from swarm.config import TrainConfig


def _invoke(flags: tuple[str, ...]) -> tuple[Result, list[TrainConfig]]:
    app, got = typer.Typer(), []

    @app.command()
    @with_train_options
    def serve(options: RunOptions) -> None:
        got.append(options.train_config())

    return CliRunner().invoke(app, list(flags)), got


def recipe(*flags: str) -> TrainConfig:
    """The recipe a user gets from these command-line flags and every other flag at its default."""
    result, got = _invoke(flags)
    assert result.exit_code == 0, result.output
    return got[0]


def refused(*flags: str) -> str:
    """The usage error these flags get; the run must not start."""
    result, got = _invoke(flags)
    assert result.exit_code == 2 and not got, result.output
    return result.output
