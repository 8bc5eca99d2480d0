"""The coordinator's state on disk: what a restarted coordinator needs to pick its run up again.

Why a file of its own: a coordinator can die (SIGKILL, a reboot) while its peers train on. Peers keep
their blocks for a grace period and redial; the restarted coordinator must then know the plan (who holds
which layers, at which endpoints, under which plan version), how far training got, which checkpoint a
recovery would restore, and the settings it ran with, so that it can adopt the peers instead of starting
over. Everything else is already on disk: the signing key and DHT identity next to the runs folder, the
checkpoints and their ``index.json``, and the step history in ``metrics.jsonl``.

The file (``runs/<name>/coordinator_state.json``) is written atomically (a temporary file, then
``os.replace``), so a kill leaves the old or the new version, never half of one. A file that does not
parse is a :class:`StateError` naming the file and what to do, never a guess.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

STATE_FILE = "coordinator_state.json"
SCHEMA = 1


class StateError(RuntimeError):
    """The saved coordinator state cannot be used; the message says which file and what to do."""


class CoordinatorState(BaseModel):
    """One snapshot of a run as its coordinator sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA
    run_id: str
    swarm: str
    settings: dict[str, Any]  # the run's model/training settings, compared on restart
    port: int = Field(ge=0, le=65535)  # the control port: the plan names it, peers redial it
    dht_port: int = Field(ge=0, le=65535)  # the DHT port: peers' initial peers name it
    plan: dict[str, Any] | None = None  # the signed plan's body (swarm.dht.schema.Plan)
    planned: dict[str, tuple[int, int, str]] = {}  # peer id -> (layer_start, layer_end, endpoint)
    reachable: dict[str, bool] = {}
    started: bool = False
    finished: bool = False
    last_step: int = Field(default=-1, ge=-1)  # the last optimizer step reported (-1: none yet)
    restore_version: int = Field(default=0, ge=0)  # the checkpoint the current plan restored
    train_seconds: float = Field(default=0.0, ge=0.0)  # training time so far (for tokens/s and the ETA)
    checkpoints: dict[str, Any] = {}  # the checkpoint index (CheckpointStore.describe())
    saved_at: float = 0.0


def state_path(run_dir: Path) -> Path:
    return run_dir / STATE_FILE


def save_state(run_dir: Path, state: CoordinatorState) -> None:
    """Write atomically: a crash leaves the previous state or this one, never a torn file."""
    path = state_path(run_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.model_dump_json())
    os.replace(tmp, path)


def load_state(run_dir: Path) -> CoordinatorState | None:
    """The saved state of the run in ``run_dir``, None when there is none; StateError when it is unusable."""
    path = state_path(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateError(f"cannot read the coordinator state {path}: {e}") from None
    hint = "move it away or start the run over with --fresh"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise StateError(f"the coordinator state {path} is not valid JSON ({e}); {hint}") from None
    if isinstance(raw, dict) and raw.get("schema_version") != SCHEMA:
        raise StateError(
            f"the coordinator state {path} has schema {raw.get('schema_version')!r}, "
            f"this coordinator reads {SCHEMA}; {hint}"
        )
    try:
        return CoordinatorState.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "the top level"
        raise StateError(f"the coordinator state {path} is damaged ({where}: {first['msg']}); {hint}") from None


def settings_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The settings that differ between a saved run and this start, as ``key: saved -> now`` lines."""
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{key}.{d}" for d in settings_diff(a, b)]
        elif a != b:
            diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs


def forget_run(run_dir: Path) -> None:
    """``--fresh``: drop the saved state and the block checkpoints, so nothing of the old run is restored."""
    state_path(run_dir).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """What the run logged to ``metrics.jsonl``; a line torn by a kill (the last one) is skipped."""
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events
