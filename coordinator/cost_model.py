"""What one pipeline stage costs a peer, per micro-batch, in seconds.

Placement (``coordinator/placement.py``) asks the same question for every block of every candidate
order ("how long does peer p take for block [a, b)?"), so the answer lives here, once, vectorised.

Model (one micro-batch, forward and backward together, steady state):

    t_p(a, b) = C(a, b) / speed_p + recv(a, b) / download_p + send(a, b) / upload_p

* ``C(a, b)`` is the summed ``layer_cost`` of layers ``a .. b-1``; ``speed_p`` is in the same
  cost units per second, so with unit layer costs it is layers per second.
* ``recv`` is what the stage takes in: activations across boundary ``a`` (unless it is the first
  stage) plus gradients across boundary ``b`` (unless it is the last). ``send`` is the mirror:
  activations across ``b`` plus gradients across ``a``.
* Compute and transfer are added, not overlapped: a home link is the scarce resource, and the
  sum is the conservative reading of "counting both compute time and transfer time".
* The peer must hold the whole block: ``M(a, b) <= free_memory_p``, where ``layer_memory``
  already counts weights, optimizer state and activations. A block that does not fit takes
  ``inf`` seconds, so one comparison against a time budget also checks memory. The last block may
  count its layers differently (``last_layer_memory``): it runs forward, loss and backward back to
  back, so it keeps one micro-batch's activations, not every one in flight.

Replicas of a block split its micro-batches, so the block's rate is the sum of its replicas'
rates and its time is ``1 / sum(1 / t_p)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "ModelSpec", "PeerSpec"]


def _finite_nonneg(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return value


def _finite_pos(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


@dataclass(frozen=True)
class PeerSpec:
    """One peer's measured capabilities.

    ``speed`` is in the model's cost units per second (see ``ModelSpec.layer_cost``); a peer that
    measured ``x`` seconds per layer per micro-batch on a model with unit layer costs has
    ``speed = 1 / x``. Bandwidths are bytes per second; memory is bytes free for its block. A peer that
    is not ``reachable`` (behind NAT) cannot accept connections, so placement keeps two such peers apart.
    """

    peer_id: str
    speed: float
    free_memory: float
    upload: float
    download: float
    reachable: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise ValueError(f"peer_id must be a non-empty string, got {self.peer_id!r}")
        _finite_pos(f"peer {self.peer_id}: speed", self.speed)
        _finite_nonneg(f"peer {self.peer_id}: free_memory", self.free_memory)
        _finite_pos(f"peer {self.peer_id}: upload", self.upload)
        _finite_pos(f"peer {self.peer_id}: download", self.download)


@dataclass(frozen=True)
class ModelSpec:
    """Per-layer costs of the model being trained.

    ``layer_cost[l]``: compute per micro-batch (forward + backward) in arbitrary units that match
    ``PeerSpec.speed``. ``layer_memory[l]``: bytes a holder of layer ``l`` needs (weights,
    optimizer state, activations in flight). ``forward_bytes[i]`` / ``backward_bytes[i]``: bytes per
    micro-batch that cross boundary ``i + 1`` (between layers ``i`` and ``i + 1``) going downstream
    (activations) and upstream (gradients), after the wire codecs. ``last_layer_memory``: bytes per
    layer when the layer is in the last block (default: ``layer_memory``).
    """

    layer_cost: tuple[float, ...]
    layer_memory: tuple[float, ...]
    forward_bytes: tuple[float, ...]
    backward_bytes: tuple[float, ...]
    last_layer_memory: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        cost = tuple(_finite_pos(f"layer_cost[{i}]", c) for i, c in enumerate(self.layer_cost))
        mem = tuple(_finite_nonneg(f"layer_memory[{i}]", m) for i, m in enumerate(self.layer_memory))
        fwd = tuple(_finite_nonneg(f"forward_bytes[{i}]", v) for i, v in enumerate(self.forward_bytes))
        bwd = tuple(_finite_nonneg(f"backward_bytes[{i}]", v) for i, v in enumerate(self.backward_bytes))
        n = len(cost)
        if n == 0:
            raise ValueError("a model needs at least one layer")
        if len(mem) != n:
            raise ValueError(f"layer_memory has {len(mem)} entries for {n} layers")
        if len(fwd) != n - 1 or len(bwd) != n - 1:
            raise ValueError(f"{n} layers have {n - 1} boundaries; got {len(fwd)} forward, {len(bwd)} backward")
        object.__setattr__(self, "layer_cost", cost)
        object.__setattr__(self, "layer_memory", mem)
        object.__setattr__(self, "forward_bytes", fwd)
        object.__setattr__(self, "backward_bytes", bwd)
        if self.last_layer_memory is not None:
            last = tuple(_finite_nonneg(f"last_layer_memory[{i}]", m) for i, m in enumerate(self.last_layer_memory))
            if len(last) != n:
                raise ValueError(f"last_layer_memory has {len(last)} entries for {n} layers")
            object.__setattr__(self, "last_layer_memory", last)

    @property
    def n_layers(self) -> int:
        return len(self.layer_cost)

    @classmethod
    def uniform(
        cls,
        n_layers: int,
        *,
        layer_memory: float,
        boundary_bytes: float,
        layer_cost: float = 1.0,
        backward_bytes: float | None = None,
    ) -> ModelSpec:
        """A stack of identical transformer blocks; gradients default to the activation size."""
        bwd = boundary_bytes if backward_bytes is None else backward_bytes
        n_b = max(n_layers - 1, 0)
        return cls(
            layer_cost=(layer_cost,) * n_layers,
            layer_memory=(layer_memory,) * n_layers,
            forward_bytes=(boundary_bytes,) * n_b,
            backward_bytes=(bwd,) * n_b,
        )


class CostModel:
    """Peers and model flattened into arrays, so block times are a few numpy operations."""

    def __init__(self, peers: Sequence[PeerSpec], model: ModelSpec) -> None:
        self.peers: tuple[PeerSpec, ...] = tuple(peers)
        self.model = model
        self.index: dict[str, int] = {}
        for i, p in enumerate(self.peers):
            if p.peer_id in self.index:
                raise ValueError(f"duplicate peer_id {p.peer_id!r}")
            self.index[p.peer_id] = i
        self.n_layers = model.n_layers
        self.inv_speed = np.array([1.0 / p.speed for p in self.peers], dtype=np.float64)
        self.inv_up = np.array([1.0 / p.upload for p in self.peers], dtype=np.float64)
        self.inv_down = np.array([1.0 / p.download for p in self.peers], dtype=np.float64)
        self.memory = np.array([p.free_memory for p in self.peers], dtype=np.float64)
        self.cost_cum = np.concatenate(([0.0], np.cumsum(model.layer_cost)))
        self.mem_cum = np.concatenate(([0.0], np.cumsum(model.layer_memory)))
        self.last_cum = np.concatenate(([0.0], np.cumsum(model.last_layer_memory or model.layer_memory)))
        # Boundary arrays indexed 0..L; the pipeline's two ends carry nothing.
        self.fwd = np.concatenate(([0.0], model.forward_bytes, [0.0]))
        self.bwd = np.concatenate(([0.0], model.backward_bytes, [0.0]))

    def times(self, idx: np.ndarray | int, a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
        """Seconds per micro-batch of peers ``idx`` on blocks ``[a, b)``, broadcast elementwise
        (``inf`` where the block does not fit the peer's memory or is empty)."""
        idx, a, b = np.asarray(idx), np.asarray(a), np.asarray(b)
        t = (
            self.inv_speed[idx] * (self.cost_cum[b] - self.cost_cum[a])
            + self.inv_down[idx] * (self.fwd[a] + self.bwd[b])
            + self.inv_up[idx] * (self.fwd[b] + self.bwd[a])
        )
        need = np.where(b == self.n_layers, self.last_cum[b] - self.last_cum[a], self.mem_cum[b] - self.mem_cum[a])
        fits = (b > a) & (self.memory[idx] >= need)
        return np.where(fits, t, np.inf)

    def stage_time(self, idx: Sequence[int] | np.ndarray, a: int, b: int) -> float:
        """Time of block ``[a, b)`` served by the replicas ``idx`` together (``inf`` if none can)."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return math.inf
        rate = float(np.sum(1.0 / self.times(idx, a, b)))
        return math.inf if rate <= 0.0 else 1.0 / rate
