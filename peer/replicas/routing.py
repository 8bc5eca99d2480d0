"""Which holder of the next block gets a micro-batch, when a block has several (replicas).

Each sender decides on its own, per micro-batch (SWARM-style stochastic wiring, made deterministic):
the replica with the smallest expected wait, ``(queued + 1) x seconds per micro-batch``, where the
seconds are learned from the sender's own round trips. A slower or busier replica gets less work
without any coordination. The router also remembers who holds each micro-batch, so when a replica
vanishes the sender knows exactly which micro-batches are lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of a new round-trip sample in the running estimate


@dataclass
class _Replica:
    outstanding: dict[int, tuple[float, int]] = field(default_factory=dict)  # mb id -> (sent at, queue ahead)
    seconds_per_mb: float | None = None
    sent: int = 0


class ReplicaRouter:
    """Routing state of one sender towards the holders of the next block; pure bookkeeping, no I/O."""

    def __init__(self, peers: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        if not peers:
            raise ValueError("a router needs at least one peer to route to")
        self._replicas = {p: _Replica() for p in peers}
        self._where: dict[int, str] = {}
        self._clock = clock

    @property
    def peers(self) -> list[str]:
        return list(self._replicas)

    def _estimate(self, r: _Replica) -> float:
        if r.seconds_per_mb is not None:
            return r.seconds_per_mb
        known = [x.seconds_per_mb for x in self._replicas.values() if x.seconds_per_mb is not None]
        return min(known) if known else 1.0  # optimistic: an untried replica gets tried

    def choose(self) -> str:
        """The replica where one more micro-batch is expected to finish first."""
        return min(
            self._replicas,
            key=lambda p: (
                (len(self._replicas[p].outstanding) + 1) * self._estimate(self._replicas[p]),
                len(self._replicas[p].outstanding),
                self._replicas[p].sent,
                p,
            ),
        )

    def sent(self, peer: str, mb_id: int) -> None:
        r = self._replicas[peer]
        r.outstanding[mb_id] = (self._clock(), len(r.outstanding))
        r.sent += 1
        self._where[mb_id] = peer

    def holder(self, mb_id: int) -> str | None:
        return self._where.get(mb_id)

    def returned(self, mb_id: int) -> str | None:
        """The micro-batch came back; learn from its round trip. Returns who held it (None: unknown)."""
        peer = self._where.pop(mb_id, None)
        if peer is None or peer not in self._replicas:
            return None
        r = self._replicas[peer]
        sent_at, ahead = r.outstanding.pop(mb_id)
        sample = (self._clock() - sent_at) / (ahead + 1)
        r.seconds_per_mb = (
            sample if r.seconds_per_mb is None else (1 - SMOOTHING) * r.seconds_per_mb + SMOOTHING * sample
        )
        return peer

    def remove(self, peer: str) -> list[int]:
        """Stop routing to ``peer``; returns the micro-batches it held, which will never come back."""
        r = self._replicas.pop(peer, None)
        if r is None:
            return []
        for mb_id in r.outstanding:
            self._where.pop(mb_id, None)
        return sorted(r.outstanding)

    def shares(self) -> dict[str, int]:
        """Micro-batches sent to each replica so far (what `ravn status` and the tests look at)."""
        return {p: r.sent for p, r in self._replicas.items()}
