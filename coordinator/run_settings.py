"""What a run is told at its start (``RunSettings``) and how it says it cannot go on (``RunFailed``).

Apart from the run itself so that every part of the coordinator (sessions, planning, recovery, the run
record) can read the settings without importing the object that composes them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.config import HFConfig, ModelConfig, TrainConfig
from swarm.security import tls


class RunFailed(RuntimeError):
    """The run cannot go on; the message says why, for the person watching."""


class NoPlanFits(RunFailed):
    """The peers, all together, do not offer the memory the model needs; the message names both."""


@dataclass
class RunSettings:
    name: str
    run_dir: Path
    model: ModelConfig
    train: TrainConfig
    peers: int
    host: str = "127.0.0.1"
    port: int = 0
    join_timeout: float = 120.0
    ready_timeout: float = 120.0
    state_timeout: float = 120.0
    model_name: str = "custom"
    swarm: str = "ravn"
    announce: str = ""
    hf: HFConfig | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    swarm_token: str = ""  # every call must prove it (empty: no authentication, tests only)
    stages: int = 0  # pipeline stages (0: one per peer); spare peers become replicas
    replicate: int = -1  # the stage that gets the replicas (-1: the slowest predicted)
    tls: tls.TlsIdentity | None = None  # Control speaks TLS with this certificate, pinned by the signed plan
    # a first plan that does not fit the peers' memory: wait for more peers or memory (serve), or fail at once
    # (ravn local, whose peers are all there from the start)
    wait_for_fit: bool = False


def settings_record(s: RunSettings) -> dict:
    """The settings a restart must repeat, as plain JSON (compared with the saved ones)."""
    record = {
        "model": asdict(s.model),
        "train": asdict(s.train),
        "hf": asdict(s.hf) if s.hf else None,
        "peers": s.peers,
        "model_name": s.model_name,
        "swarm": s.swarm,
    }
    return json.loads(json.dumps(record, default=str))
