"""What a peer is told before it has an assignment: one typed object, read by every part of the peer.

Test knobs are not here: they live in :class:`peer.faults.Faults`, so a real peer's settings say only
what a real peer does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.security import tls


@dataclass
class PeerSettings:
    """Everything a peer needs to know before it has an assignment."""

    peer_id: str
    host: str = "127.0.0.1"
    port: int = 0
    announce: str = ""
    device: str = "auto"
    threads: int = 0
    report_interval: float = 1.0
    step_timeout: float = 300.0
    link_timeout: float = 30.0
    plan_timeout: float = 600.0
    status_every: float = 10.0  # seconds between the one-line live status in the log
    leave_timeout: float = 60.0  # how long a graceful leave waits for the coordinator to take the block
    coordinator_grace: float = 60.0  # how long to train on and redial when the coordinator is gone (0: exit at once)
    memory_limit: int = 0  # the most memory (bytes) this peer offers the plan (0: what it measures free)
    hf_path: str = ""  # where this peer keeps the Hugging Face checkpoint, if not where the coordinator says
    metrics_port: int | None = None  # Prometheus endpoint (None: off)
    metrics_host: str = "127.0.0.1"
    swarm_token: str = ""  # proof of membership on every gRPC call (empty: no authentication, tests only)
    tls: tls.TlsIdentity | None = None  # the Stage service speaks TLS with this certificate (None: in clear)
    # the coordinator key whose signed plans this peer obeys, and the swarm they must name; with discovery,
    # discovery's pinned key and swarm are used (the same that DHT plans are checked with)
    coordinator_key: str = ""
    swarm: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def offered_memory(self, measured_free: int) -> int:
        """The memory this peer announces: what it measured free, or ``--memory`` when that is smaller."""
        return min(measured_free, self.memory_limit) if self.memory_limit else measured_free

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device
