"""The health verdict of a status snapshot (the first line of ``ravn status``, its exit code) and ``--json``.

Rules (the most severe level wins, problems listed in order):

===========  ====================================================================================
broken       the run reports a failure; a block has no live replica (``layers [a,b) uncovered``) and
             no recovery is under way; the blocks leave a gap in the layers.
degraded     the coordinator is recovering from a lost peer (``recovering``: from detection until the
             swarm has trained its first step again; an uncovered block counts as degraded meanwhile);
             no plan yet (still waiting for peers); a peer's last heartbeat is older than
             3 heartbeats; a peer dropped stale gradients or refused packets in the last window
             (``dropped_recent`` / ``refused_recent`` > 0: the totals are rising). Gradients at the
             async bound S are not a problem: running S versions ahead is what the schedule is for
             (each is applied through the weights its forward saw); one past it is dropped, and that is.
healthy      none of the above.
===========  ====================================================================================

The verdict is judged by the client from the data (``coordinator.status_data``), not sent by the
coordinator, so an old coordinator's snapshot is judged by this ravn's rules. The JSON shape of
:func:`status_json` is documented in ``coordinator.status_data``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from coordinator.status_data import Block, SwarmStatus, layers_text

SILENT_HEARTBEATS = 3  # a peer silent for longer than this many heartbeats is about to expire

Level = Literal["healthy", "degraded", "broken"]
Severity = Literal["degraded", "broken"]


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
        where = f"layers {layers_text(first.block)}: " if first.block and "layers [" not in first.why else ""
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
                    f"layers {layers_text(b.layers)} uncovered: no live peer holds them",
                    block=b.layers,
                )
            )
    for gap in _gaps([b.layers for b in status.blocks]):
        broken.append(Problem("broken", f"layers {layers_text(gap)} are in no block of the plan", block=gap))
    if not status.blocks and not run.failure:
        degraded.append(Problem("degraded", f"no plan yet: {run.waiting or 'waiting for peers to join'}"))
    silent_after = SILENT_HEARTBEATS * run.heartbeat_s
    silent, rising = [], []  # degraded problems, most urgent kind first
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
    degraded += silent + rising
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


# ---- the --json document ----------------------------------------------------------------------
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
