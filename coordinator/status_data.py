"""The status of a swarm as data: one typed snapshot, its JSON transport form, and what builds it.

Why pure functions over frozen dataclasses: the coordinator builds a :class:`SwarmStatus` (it alone knows
the plan, the sessions and the losses), ships it as ``SwarmStatus.to_dict()`` JSON in the ``Status`` RPC,
and the ``ravn status`` client turns it back with :meth:`SwarmStatus.from_dict` (strictly: it is data from
the network). The verdict rules are ``coordinator.status_verdict``; the rich rendering is
``coordinator.status_view``. Nothing here does I/O or draws, so each part is tested alone.

JSON shape of ``status_verdict.status_json`` (``--json``; keys are stable, new keys may be added, none
renamed); :meth:`SwarmStatus.to_dict` is the same without ``verdict`` and the derived keys
(``staleness_p50``, ``staleness_p99``, ``covered``):

.. code-block:: text

    {"schema": 1, "swarm": str, "generated_at": unix seconds,
     "verdict": {"level": "healthy"|"degraded"|"broken", "line": str,
                 "problems": [{"severity": "degraded"|"broken", "why": str,
                               "block": [a, b] | null, "peer": str | null}]},
     "run": {"name", "step", "total_steps", "loss", "val_loss", "tokens_per_s", "eta_s",
             "wire_bytes_per_token", "loss_history": [float], "heartbeat_s", "max_staleness", "failure",
             "recovering", "recovering_layers": [a, b] | null, "waiting": str},
     "peers": [{"name", "device", "block": [a, b], "state", "tokens_per_s", "up_mbit_s", "down_mbit_s",
                "staleness_counts": [int], "staleness_p50", "staleness_p99", "heartbeat_age_s",
                "dropped", "refused", "dropped_recent", "refused_recent", "bubble_fraction",
                "kept_weights_bytes_peak", "held_gradient_bytes_peak"}],
     "blocks": [{"layers": [a, b], "replicas": int, "covered": bool, "bottleneck": bool}],
     "excluded": [{"name": str, "reason": str}],
     "links": [{"boundary": int, "upstream": str, "downstream": str, "forward": str, "backward": str,
                "forward_mbit_s", "backward_mbit_s", "forward_reason": str, "backward_reason": str,
                "backward_error_feedback": bool}]}

``excluded`` lists peers the coordinator dropped from the plan for the rest of the run (a neighbour
quarantined them for implausible activations or gradients) and why. ``links`` are the current plan's links
(``boundary`` i: stage i -> i + 1) with the codec each direction sends, the measured Mbit/s it was chosen
from and why (``coordinator/wire_choice.py``), and whether its gradients carry error feedback.

Unknown numbers are ``null`` (never NaN). ``step`` counts completed optimizer steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from swarm.metrics import stage_rates
from swarm.pb import control_pb2 as cpb

SCHEMA = 1
MAX_PEERS = 100_000
MAX_LIST = 4096

Block = tuple[int, int]


# ---- the snapshot --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunStatus:
    name: str
    step: int  # optimizer steps completed
    total_steps: int
    loss: float | None = None  # last training loss (nats/token)
    val_loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    wire_bytes_per_token: float | None = None
    loss_history: tuple[float, ...] = ()  # recent training losses, oldest first (the sparkline)
    heartbeat_s: float = 5.0  # the swarm's heartbeat: what "silent" is measured in
    max_staleness: int = 0  # the async bound S (0: sync, the staleness rule is off)
    failure: str = ""  # why the run failed, if it did
    recovering: str = ""  # what the coordinator is recovering from, while it does (e.g. "lost peer p2 (...)")
    recovering_layers: Block | None = None  # the block that lost its peer, when one did
    waiting: str = ""  # why there is no plan yet beyond peers still to come (the first did not fit their memory)


@dataclass(frozen=True)
class PeerStatus:
    name: str
    device: str
    block: Block  # layers [a, b)
    state: str  # joining / online / leaving, or the coordinator's own word (ready, training, lost)
    tokens_per_s: float | None = None
    up_mbit_s: float | None = None
    down_mbit_s: float | None = None
    staleness_counts: tuple[int, ...] = ()  # applied gradients by staleness 0, 1, 2, ...
    heartbeat_age_s: float = 0.0  # seconds since the coordinator last heard from this peer
    dropped: int = 0  # totals since the block was assigned
    refused: int = 0
    dropped_recent: int = 0  # in the last window: > 0 means the total is rising
    refused_recent: int = 0
    bubble_fraction: float | None = None
    kept_weights_bytes_peak: int = 0  # trainable weights kept for stale backwards (async), at their peak
    held_gradient_bytes_peak: int = 0  # gradients held till their own step's update (async), at their peak

    @property
    def staleness_p50(self) -> int | None:
        return staleness_percentile(self.staleness_counts, 0.50)

    @property
    def staleness_p99(self) -> int | None:
        return staleness_percentile(self.staleness_counts, 0.99)


@dataclass(frozen=True)
class BlockStatus:
    layers: Block
    replicas: int  # live peers holding this block
    bottleneck: bool = False  # the stage that limits the pipeline's throughput

    @property
    def covered(self) -> bool:
        return self.replicas > 0


@dataclass(frozen=True)
class ExcludedPeer:
    name: str
    reason: str  # why, and which neighbour reported it


@dataclass(frozen=True)
class LinkStatus:
    """One link of the plan: ``upstream`` (stage ``boundary``) -> ``downstream`` (stage ``boundary + 1``)."""

    boundary: int
    upstream: str
    downstream: str
    forward: str
    backward: str
    forward_mbit_s: float | None = None
    backward_mbit_s: float | None = None
    forward_reason: str = ""
    backward_reason: str = ""
    backward_error_feedback: bool = False  # its gradients carry a residual (``--error-feedback-backward``)


@dataclass(frozen=True)
class SwarmStatus:
    run: RunStatus
    peers: tuple[PeerStatus, ...] = ()
    blocks: tuple[BlockStatus, ...] = ()
    swarm: str = ""
    generated_at: float = 0.0  # unix seconds, coordinator clock
    excluded: tuple[ExcludedPeer, ...] = ()
    links: tuple[LinkStatus, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (the transport form; no verdict, no derived fields)."""
        return {
            "schema": SCHEMA,
            "swarm": self.swarm,
            "generated_at": self.generated_at,
            "run": {
                **_fields(self.run),
                "loss_history": [_finite(x) for x in self.run.loss_history],
                "recovering_layers": list(self.run.recovering_layers) if self.run.recovering_layers else None,
            },
            "peers": [
                {**_fields(p), "block": list(p.block), "staleness_counts": list(p.staleness_counts)} for p in self.peers
            ],
            "blocks": [
                {"layers": list(b.layers), "replicas": b.replicas, "bottleneck": b.bottleneck} for b in self.blocks
            ],
            "excluded": [{"name": e.name, "reason": e.reason} for e in self.excluded],
            "links": [_fields(x) for x in self.links],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SwarmStatus:
        """Parse :meth:`to_dict` output (or :func:`status_json`); raises ``ValueError`` naming the bad field.

        Unknown keys are ignored (a newer coordinator may send more); derived keys are recomputed.
        """
        r = _Reader(d, "status")
        if r.count("schema", default=SCHEMA) != SCHEMA:
            raise ValueError(f"status: schema {d.get('schema')!r} is not supported (this ravn reads {SCHEMA})")
        run = r.sub("run")
        return cls(
            run=RunStatus(
                name=run.text("name"),
                step=run.count("step"),
                total_steps=run.count("total_steps"),
                loss=run.num("loss"),
                val_loss=run.num("val_loss"),
                tokens_per_s=run.num("tokens_per_s"),
                eta_s=run.num("eta_s"),
                wire_bytes_per_token=run.num("wire_bytes_per_token"),
                loss_history=tuple(x for x in run.nums("loss_history") if x is not None),
                heartbeat_s=run.num("heartbeat_s", default=5.0) or 5.0,
                max_staleness=run.count("max_staleness", default=0),
                failure=run.text("failure", default=""),
                recovering=run.text("recovering", default=""),
                recovering_layers=run.optional_block("recovering_layers"),
                waiting=run.text("waiting", default=""),
            ),
            peers=tuple(
                PeerStatus(
                    name=p.text("name"),
                    device=p.text("device", default=""),
                    block=p.block("block"),
                    state=p.text("state", default=""),
                    tokens_per_s=p.num("tokens_per_s"),
                    up_mbit_s=p.num("up_mbit_s"),
                    down_mbit_s=p.num("down_mbit_s"),
                    staleness_counts=tuple(p.ints("staleness_counts")),
                    heartbeat_age_s=p.num("heartbeat_age_s", default=0.0) or 0.0,
                    dropped=p.count("dropped", default=0),
                    refused=p.count("refused", default=0),
                    dropped_recent=p.count("dropped_recent", default=0),
                    refused_recent=p.count("refused_recent", default=0),
                    bubble_fraction=p.num("bubble_fraction"),
                    kept_weights_bytes_peak=p.count("kept_weights_bytes_peak", default=0),
                    held_gradient_bytes_peak=p.count("held_gradient_bytes_peak", default=0),
                )
                for p in r.subs("peers", MAX_PEERS)
            ),
            blocks=tuple(
                BlockStatus(
                    layers=b.block("layers"),
                    replicas=b.count("replicas"),
                    bottleneck=b.flag("bottleneck", default=False),
                )
                for b in r.subs("blocks", MAX_LIST)
            ),
            swarm=r.text("swarm", default=""),
            generated_at=r.num("generated_at", default=0.0) or 0.0,
            excluded=tuple(
                ExcludedPeer(name=e.text("name"), reason=e.text("reason", default=""))
                for e in r.subs("excluded", MAX_LIST)
            ),
            links=tuple(
                LinkStatus(
                    boundary=x.count("boundary"),
                    upstream=x.text("upstream"),
                    downstream=x.text("downstream"),
                    forward=x.text("forward"),
                    backward=x.text("backward"),
                    forward_mbit_s=x.num("forward_mbit_s"),
                    backward_mbit_s=x.num("backward_mbit_s"),
                    forward_reason=x.text("forward_reason", default=""),
                    backward_reason=x.text("backward_reason", default=""),
                    backward_error_feedback=x.flag("backward_error_feedback", default=False),
                )
                for x in r.subs("links", MAX_LIST)
            ),
        )


def _fields(obj: Any) -> dict[str, Any]:
    return {k: (_finite(v) if isinstance(v, float) else v) for k, v in obj.__dict__.items()}


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


class _Reader:
    """Typed access to untrusted JSON-ish data; every error names the path of the bad field."""

    _MISSING = object()

    def __init__(self, d: Any, path: str) -> None:
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: expected an object, got {type(d).__name__}")
        self.d, self.path = d, path

    def _get(self, key: str, default: Any) -> Any:
        v = self.d.get(key, default)
        if v is self._MISSING:
            raise ValueError(f"{self.path}.{key}: missing")
        return v

    def _bad(self, key: str, want: str, v: Any) -> ValueError:
        return ValueError(f"{self.path}.{key}: expected {want}, got {v!r:.60}")

    def text(self, key: str, default: Any = _MISSING) -> str:
        v = self._get(key, default)
        if not isinstance(v, str) or len(v) > 4096:
            raise self._bad(key, "a string", v)
        return v

    def count(self, key: str, default: Any = _MISSING) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise self._bad(key, "a non-negative integer", v)
        return v

    def flag(self, key: str, default: Any = _MISSING) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, "true or false", v)
        return v

    def num(self, key: str, default: Any = None) -> float | None:
        v = self._get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self._bad(key, "a number or null", v)
        return _finite(float(v))

    def _list(self, key: str, limit: int = MAX_LIST) -> list:
        v = self._get(key, [])
        if not isinstance(v, list) or len(v) > limit:
            raise self._bad(key, f"a list of at most {limit} items", v)
        return v

    def nums(self, key: str) -> list[float | None]:
        return [_Reader({"x": x}, f"{self.path}.{key}[{i}]").num("x") for i, x in enumerate(self._list(key))]

    def ints(self, key: str) -> list[int]:
        return [_Reader({"x": x}, f"{self.path}.{key}[{i}]").count("x") for i, x in enumerate(self._list(key))]

    def block(self, key: str) -> Block:
        v = self._get(key, self._MISSING)
        ok = isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if not ok or not 0 <= v[0] < v[1]:
            raise self._bad(key, "[a, b] with 0 <= a < b", v)
        return (v[0], v[1])

    def optional_block(self, key: str) -> Block | None:
        return None if self.d.get(key) is None else self.block(key)

    def sub(self, key: str) -> _Reader:
        return _Reader(self._get(key, self._MISSING), f"{self.path}.{key}")

    def subs(self, key: str, limit: int) -> list[_Reader]:
        return [_Reader(x, f"{self.path}.{key}[{i}]") for i, x in enumerate(self._list(key, limit))]


# ---- building blocks for the producer (the coordinator) ------------------------------------------
def staleness_percentile(counts: Sequence[int], q: float) -> int | None:
    """The smallest staleness s with at least ``q`` of the applied gradients at s or fresher; None if none applied."""
    total = sum(counts)
    if total <= 0:
        return None
    need, running = q * total, 0
    for staleness, n in enumerate(counts):
        running += n
        if running >= need:
            return staleness
    return len(counts) - 1


def eta_seconds(steps_done: int, total_steps: int, elapsed_s: float) -> float | None:
    """Remaining time at the mean pace so far; None before the first step."""
    if steps_done <= 0 or elapsed_s <= 0:
        return None
    return max(total_steps - steps_done, 0) * elapsed_s / steps_done


def peer_status_from_stats(
    *,
    name: str,
    device: str,
    block: Block,
    state: str,
    now: cpb.StageStats,
    then: cpb.StageStats | None,
    window_s: float,
    heartbeat_age_s: float,
    tokens_per_micro_batch: int,
) -> PeerStatus:
    """A peer's row from two of its ``StageStats`` reports taken ``window_s`` apart (``then`` may be None)."""
    rates = stage_rates(then, now, window_s, tokens_per_micro_batch)
    return PeerStatus(
        name=name,
        device=device,
        block=block,
        state=state,
        tokens_per_s=rates.tokens_per_s,
        up_mbit_s=rates.up_mbit_s,
        down_mbit_s=rates.down_mbit_s,
        staleness_counts=tuple(now.staleness_counts),
        heartbeat_age_s=heartbeat_age_s,
        dropped=now.dropped,
        refused=now.refused,
        dropped_recent=rates.dropped,
        refused_recent=rates.refused,
        bubble_fraction=rates.bubble_fraction,
        kept_weights_bytes_peak=now.kept_weights_bytes_peak,
        held_gradient_bytes_peak=now.held_gradient_bytes_peak,
    )


def blocks_from_peers(
    peers: Iterable[PeerStatus],
    planned: Iterable[Block],
    *,
    live_states: frozenset[str] = frozenset({"joining", "online", "ready", "training"}),
    replicas: Mapping[Block, int] | None = None,
) -> tuple[BlockStatus, ...]:
    """One row per planned block: live replicas, and the bottleneck (the busiest block: least idle).

    Replicas are the peers in ``live_states`` holding the block, unless the producer knows better and
    passes ``replicas`` (the coordinator counts planned peers whose DHT record is alive, including those
    still dialling in). In a pipeline every stage sees the same tokens, so throughput is set by the stage
    that is never idle; its bubble fraction is the smallest. Without bubble data there is no bottleneck.
    """
    peers = list(peers)
    rows, idle = [], {}
    for layers in sorted(set(planned)):
        holders = [p for p in peers if p.block == layers and p.state in live_states]
        bubbles = [p.bubble_fraction for p in holders if p.bubble_fraction is not None]
        if bubbles:
            idle[layers] = sum(bubbles) / len(bubbles)
        count = len(holders) if replicas is None else replicas.get(layers, 0)
        rows.append(BlockStatus(layers=layers, replicas=count))
    busiest = min(idle, key=idle.get) if len(idle) > 1 else None
    return tuple(replace(b, bottleneck=b.layers == busiest) for b in rows)


def layers_text(block: Block | None) -> str:
    """``[a,b)``, the one way a block is written in verdict lines and tables ("" for none)."""
    return f"[{block[0]},{block[1]})" if block else ""
