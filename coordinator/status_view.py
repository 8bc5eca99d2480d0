"""``ravn status``: one typed snapshot of a swarm, a health verdict, a rich layout and a stable JSON shape.

Why pure functions over a dataclass: the coordinator builds a :class:`SwarmStatus` (it alone knows the
plan, the sessions and the losses), ships it as ``SwarmStatus.to_dict()`` JSON, and the ``ravn status``
client turns it back with :meth:`SwarmStatus.from_dict`, judges it with :func:`verdict` and shows it with
:func:`render` or :func:`status_json`. None of these functions does I/O, so each rule is tested alone.

Verdict rules (the first line of ``ravn status``; the most severe level wins, problems listed in order):

===========  ====================================================================================
broken       the run reports a failure; a block has no live replica (``layers [a,b) uncovered``) and
             no recovery is under way; the blocks leave a gap in the layers.
degraded     the coordinator is recovering from a lost peer (``recovering``: from detection until the
             swarm has trained its first step again; an uncovered block counts as degraded meanwhile);
             no plan yet (still waiting for peers); a peer's last heartbeat is older than
             3 heartbeats; a peer dropped stale gradients or refused packets in the last window
             (``dropped_recent`` / ``refused_recent`` > 0: the totals are rising); with an async
             schedule (``max_staleness`` S > 0), a peer's staleness p99 is at the bound S.
healthy      none of the above.
===========  ====================================================================================

JSON shape of :func:`status_json` (``--json``; keys are stable, new keys may be added, none renamed):

.. code-block:: text

    {"schema": 1, "swarm": str, "generated_at": unix seconds,
     "verdict": {"level": "healthy"|"degraded"|"broken", "line": str,
                 "problems": [{"severity": "degraded"|"broken", "why": str,
                               "block": [a, b] | null, "peer": str | null}]},
     "run": {"name", "step", "total_steps", "loss", "val_loss", "tokens_per_s", "eta_s",
             "wire_bytes_per_token", "loss_history": [float], "heartbeat_s", "max_staleness", "failure",
             "recovering", "recovering_layers": [a, b] | null},
     "peers": [{"name", "device", "block": [a, b], "state", "tokens_per_s", "up_mbit_s", "down_mbit_s",
                "staleness_counts": [int], "staleness_p50", "staleness_p99", "heartbeat_age_s",
                "dropped", "refused", "dropped_recent", "refused_recent", "bubble_fraction"}],
     "blocks": [{"layers": [a, b], "replicas": int, "covered": bool, "bottleneck": bool}],
     "excluded": [{"name": str, "reason": str}]}

``excluded`` lists peers the coordinator dropped from the plan for the rest of the run (a neighbour
quarantined them for implausible activations or gradients) and why.

Unknown numbers are ``null`` (never NaN). ``step`` counts completed optimizer steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from swarm.metrics import stage_rates
from swarm.pb import control_pb2 as cpb

SCHEMA = 1
SILENT_HEARTBEATS = 3  # a peer silent for longer than this many heartbeats is about to expire
SPARK = "▁▂▃▄▅▆▇█"
MAX_PEERS = 100_000
MAX_LIST = 4096

Level = Literal["healthy", "degraded", "broken"]
Severity = Literal["degraded", "broken"]
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
class SwarmStatus:
    run: RunStatus
    peers: tuple[PeerStatus, ...] = ()
    blocks: tuple[BlockStatus, ...] = ()
    swarm: str = ""
    generated_at: float = 0.0  # unix seconds, coordinator clock
    excluded: tuple[ExcludedPeer, ...] = ()

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


# ---- the verdict ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    severity: Severity
    why: str
    block: Block | None = None
    peer: str | None = None


@dataclass(frozen=True)
class Verdict:
    level: Level
    problems: tuple[Problem, ...] = field(default=())

    def line(self) -> str:
        """``healthy``, ``degraded (layers [2,4): peer p2 silent for 17 s ...)``, ``broken (...)``."""
        if not self.problems:
            return self.level
        first = self.problems[0]
        where = f"layers {_layers(first.block)}: " if first.block and "layers [" not in first.why else ""
        more = f"; +{len(self.problems) - 1} more" if len(self.problems) > 1 else ""
        return f"{self.level} ({where}{first.why}{more})"


def verdict(status: SwarmStatus) -> Verdict:
    """Judge a snapshot by the rules in the module docstring."""
    run = status.run
    broken: list[Problem] = []
    degraded: list[Problem] = []
    if run.failure:
        broken.append(Problem("broken", f"run failed: {run.failure}"))
    if run.recovering:
        degraded.append(Problem("degraded", f"{run.recovering}; recovering", block=run.recovering_layers))
    for b in sorted(status.blocks, key=lambda b: b.layers):
        if not b.covered:  # while the coordinator recovers, an uncovered block is being restored: degraded
            (degraded if run.recovering else broken).append(
                Problem(
                    "degraded" if run.recovering else "broken",
                    f"layers {_layers(b.layers)} uncovered: no live peer holds them",
                    block=b.layers,
                )
            )
    for gap in _gaps([b.layers for b in status.blocks]):
        broken.append(Problem("broken", f"layers {_layers(gap)} are in no block of the plan", block=gap))
    if not status.blocks and not run.failure:
        degraded.append(Problem("degraded", "no plan yet: waiting for peers to join"))
    silent_after = SILENT_HEARTBEATS * run.heartbeat_s
    silent, rising, stale = [], [], []  # degraded problems, most urgent kind first
    for p in status.peers:
        if p.heartbeat_age_s > silent_after:
            silent.append(
                Problem(
                    "degraded",
                    f"peer {p.name} silent for {p.heartbeat_age_s:.0f} s (over {SILENT_HEARTBEATS} heartbeats "
                    f"of {run.heartbeat_s:g} s)",
                    block=p.block,
                    peer=p.name,
                )
            )
        if p.dropped_recent > 0:
            rising.append(
                Problem(
                    "degraded",
                    f"peer {p.name} dropped {p.dropped_recent} stale gradients recently ({p.dropped} in all)",
                    block=p.block,
                    peer=p.name,
                )
            )
        if p.refused_recent > 0:
            rising.append(
                Problem(
                    "degraded",
                    f"peer {p.name} refused {p.refused_recent} packets recently ({p.refused} in all)",
                    block=p.block,
                    peer=p.name,
                )
            )
        p99 = p.staleness_p99
        if run.max_staleness > 0 and p99 is not None and p99 >= run.max_staleness:
            stale.append(
                Problem(
                    "degraded",
                    f"peer {p.name} staleness p99 {p99} is at the bound {run.max_staleness}",
                    block=p.block,
                    peer=p.name,
                )
            )
    degraded += silent + rising + stale
    problems = tuple(broken + degraded)
    level: Level = "broken" if broken else "degraded" if degraded else "healthy"
    return Verdict(level, problems)


def exit_code(v: Verdict) -> int:
    """For scripts and health checks: 0 healthy, 1 degraded, 2 broken."""
    return {"healthy": 0, "degraded": 1, "broken": 2}[v.level]


def _gaps(blocks: list[Block]) -> list[Block]:
    gaps, reach = [], 0
    for a, b in sorted(blocks):
        if a > reach:
            gaps.append((reach, a))
        reach = max(reach, b)
    return gaps


def _layers(block: Block | None) -> str:
    return f"[{block[0]},{block[1]})" if block else ""


# ---- JSON and rich -------------------------------------------------------------------------------
def status_json(status: SwarmStatus, v: Verdict | None = None) -> dict[str, Any]:
    """The ``--json`` document: :meth:`SwarmStatus.to_dict` plus the verdict and derived fields."""
    v = v or verdict(status)
    d = status.to_dict()
    d["verdict"] = {
        "level": v.level,
        "line": v.line(),
        "problems": [
            {"severity": p.severity, "why": p.why, "block": list(p.block) if p.block else None, "peer": p.peer}
            for p in v.problems
        ],
    }
    for row, p in zip(d["peers"], status.peers, strict=True):
        row["staleness_p50"], row["staleness_p99"] = p.staleness_p50, p.staleness_p99
    for row, b in zip(d["blocks"], status.blocks, strict=True):
        row["covered"] = b.covered
    return d


def sparkline(values: Sequence[float], width: int = 30) -> str:
    """Unicode bars for the loss history, resampled to at most ``width`` characters (means per bucket)."""
    xs = [x for x in values if math.isfinite(x)]
    if not xs:
        return ""
    if len(xs) > width:
        xs = [
            sum(chunk) / len(chunk)
            for chunk in (xs[i * len(xs) // width : (i + 1) * len(xs) // width] for i in range(width))
        ]
    lo, hi = min(xs), max(xs)
    if hi - lo < 1e-12:
        return SPARK[len(SPARK) // 2] * len(xs)
    return "".join(SPARK[round((x - lo) / (hi - lo) * (len(SPARK) - 1))] for x in xs)


_STYLE = {"healthy": "bold green", "degraded": "bold yellow", "broken": "bold red"}


def run_line(run: RunStatus) -> Text:
    pct = f" ({100 * run.step / run.total_steps:.0f}%)" if run.total_steps else ""
    parts = [f"run {run.name}", f"step {run.step}/{run.total_steps}{pct}"]
    if run.loss is not None:
        spark = sparkline(run.loss_history)
        parts.append(f"loss {run.loss:.3f}" + (f" {spark}" if spark else ""))
    if run.val_loss is not None:
        parts.append(f"val {run.val_loss:.3f}")
    parts.append(f"{_fmt(run.tokens_per_s, ',.0f')} tok/s")
    parts.append(f"ETA {_duration(run.eta_s)}")
    parts.append(f"wire {_fmt(run.wire_bytes_per_token, ',.0f')} B/token")
    return Text("  ".join(parts))


def peers_table(status: SwarmStatus, v: Verdict) -> Table:
    flagged = {p.peer: p.severity for p in v.problems if p.peer}
    t = Table(title="peers", title_justify="left", expand=False)
    for col, justify in (
        ("peer", "left"),
        ("device", "left"),
        ("block", "left"),
        ("state", "left"),
        ("tok/s", "right"),
        ("up Mbit/s", "right"),
        ("down Mbit/s", "right"),
        ("stale p50/p99", "right"),
        ("heartbeat", "right"),
    ):
        t.add_column(col, justify=justify)
    for p in sorted(status.peers, key=lambda p: (p.block, p.name)):
        stale = "-" if p.staleness_p50 is None else f"{p.staleness_p50}/{p.staleness_p99}"
        style = {"broken": "red", "degraded": "yellow"}.get(flagged.get(p.name, ""), "")
        t.add_row(
            p.name,
            p.device,
            _layers(p.block),
            p.state,
            _fmt(p.tokens_per_s, ",.0f"),
            _fmt(p.up_mbit_s, ".1f"),
            _fmt(p.down_mbit_s, ".1f"),
            stale,
            f"{p.heartbeat_age_s:.0f} s ago",
            style=style,
        )
    return t


def blocks_table(status: SwarmStatus) -> Table:
    t = Table(title="blocks", title_justify="left", expand=False)
    for col, justify in (("layers", "left"), ("replicas", "right"), ("covered", "left"), ("", "left")):
        t.add_column(col, justify=justify)
    for b in sorted(status.blocks, key=lambda b: b.layers):
        t.add_row(
            _layers(b.layers),
            str(b.replicas),
            "yes" if b.covered else "NO",
            "◀ bottleneck" if b.bottleneck else "",
            style="" if b.covered else "bold red",
        )
    return t


def excluded_table(status: SwarmStatus) -> Table:
    t = Table(title="excluded peers", title_justify="left", expand=False)
    t.add_column("peer", justify="left")
    t.add_column("why", justify="left")
    for e in status.excluded:
        t.add_row(e.name, e.reason, style="red")
    return t


def renderable(status: SwarmStatus, v: Verdict | None = None) -> RenderableType:
    """Verdict line, run line, peers table, blocks table, excluded peers, then every problem beyond the first."""
    v = v or verdict(status)
    parts: list[RenderableType] = [Text(v.line(), style=_STYLE[v.level]), run_line(status.run)]
    parts += [peers_table(status, v), blocks_table(status)]
    if status.excluded:
        parts.append(excluded_table(status))
    parts += [Text(f"  {p.severity}: {p.why}", style=_STYLE[p.severity].split()[-1]) for p in v.problems[1:]]
    return Group(*parts)


def render(status: SwarmStatus, console: Console) -> Verdict:
    """Print the status to ``console``; returns the verdict (for the exit code)."""
    v = verdict(status)
    console.print(renderable(status, v))
    return v


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {sec:02d}s" if m else f"{sec}s"
