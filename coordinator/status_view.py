"""``ravn status`` on a terminal: the verdict line, the run line, the peers, blocks, links and excluded-peers tables.

Rendering only: the snapshot and its JSON are ``coordinator.status_data``, the verdict is
``coordinator.status_verdict``. :func:`renderable` builds one rich renderable from a snapshot, so the
one-shot print (:func:`render`) and ``--watch`` (a ``rich.live.Live`` redrawn with it) show the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from coordinator.status_data import RunStatus, SwarmStatus, layers_text
from coordinator.status_verdict import Verdict, verdict

SPARK = "▁▂▃▄▅▆▇█"


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
        ("Mbit/s up/down", "right"),
        ("stale 0/1/…", "right"),
        ("bubble", "right"),
        ("kept", "right"),
        ("heartbeat", "right"),
    ):
        t.add_column(col, justify=justify)
    for p in sorted(status.peers, key=lambda p: (p.block, p.name)):
        style = {"broken": "red", "degraded": "yellow"}.get(flagged.get(p.name, ""), "")
        t.add_row(
            p.name,
            p.device,
            layers_text(p.block),
            p.state,
            _fmt(p.tokens_per_s, ",.0f"),
            f"{_fmt(p.up_mbit_s, '.1f')}/{_fmt(p.down_mbit_s, '.1f')}",
            staleness_histogram(p.staleness_counts),
            _fmt(p.bubble_fraction, ".0%"),
            _bytes(p.kept_weights_bytes_peak + p.held_gradient_bytes_peak),  # what async holds; --json splits it
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
            layers_text(b.layers),
            str(b.replicas),
            "yes" if b.covered else "NO",
            "◀ bottleneck" if b.bottleneck else "",
            style="" if b.covered else "bold red",
        )
    return t


def links_table(status: SwarmStatus) -> Table:
    """Each link of the plan with the codec each direction sends, and the measured Mbit/s it was chosen from."""
    blocks = sorted(b.layers for b in status.blocks)  # in pipeline order: block i is stage i

    def stage(i: int) -> str:
        return f"{i} {layers_text(blocks[i])}" if i < len(blocks) else str(i)

    t = Table(title="links", title_justify="left", expand=False)
    for col, justify in (
        ("stages", "left"),
        ("from -> to", "left"),
        ("forward", "left"),
        ("Mbit/s", "right"),
        ("backward", "left"),
        ("Mbit/s", "right"),
        ("why", "left"),
    ):
        t.add_column(col, justify=justify)
    for x in sorted(status.links, key=lambda x: (x.boundary, x.upstream, x.downstream)):
        why = x.forward_reason if x.forward_reason == x.backward_reason else f"{x.forward_reason}; {x.backward_reason}"
        t.add_row(
            f"{stage(x.boundary)} -> {stage(x.boundary + 1)}",
            f"{x.upstream} -> {x.downstream}",
            x.forward,
            _fmt(x.forward_mbit_s, ".1f"),
            f"{x.backward} + error feedback" if x.backward_error_feedback else x.backward,
            _fmt(x.backward_mbit_s, ".1f"),
            why,
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
    if status.links:
        parts.append(links_table(status))
    if status.excluded:
        parts.append(excluded_table(status))
    parts += [Text(f"  {p.severity}: {p.why}", style=_STYLE[p.severity].split()[-1]) for p in v.problems[1:]]
    return Group(*parts)


def render(status: SwarmStatus, console: Console) -> Verdict:
    """Print the status to ``console``; returns the verdict (for the exit code)."""
    v = verdict(status)
    console.print(renderable(status, v))
    return v


def staleness_histogram(counts: tuple[int, ...]) -> str:
    """Applied gradients by staleness 0, 1, 2, … as percentages: "14/86" is 14% fresh, 86% one version late."""
    total = sum(counts)
    if not total:
        return "-"
    return "/".join(f"{100 * n / total:.0f}" for n in counts) + "%"


def _bytes(n: int) -> str:
    if n <= 0:
        return "-"
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {sec:02d}s" if m else f"{sec}s"
