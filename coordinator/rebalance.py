"""Rebalancing decisions when peers join, leave or expire: new plan, or keep the current one.

Moving a peer to another block costs real time (it downloads new weights, its neighbours
re-wire), and predicted throughput is only a prediction, so the rule is conservative:

* An **uncovered** block (every peer holding it is gone) always forces a change.
* Placing a peer that holds no block (a newcomer, or one the plan left unused) never disturbs
  anyone, so it is done whenever it helps, or harms nothing.
* Anything that moves an existing peer to a different block (a *reshuffle*) must predict at
  least ``min_gain`` more throughput (relative) than the best option that moves fewer peers.
  This hysteresis is what keeps a swarm with jittery measurements from thrashing.

Candidates range from cheapest to most thorough: keep, fill (idle peers take uncovered blocks
and become replicas of the most loaded stages), steal (a replica moves to an uncovered block),
merge (an uncovered block's layers go to its neighbours), a single replica moved to the
bottleneck, re-splitting the current replica sets, re-assigning peers to the current blocks,
and a full re-plan. All are scored with the same cost model as the planner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.cost_model import CostModel, InfeasiblePlanError, ModelSpec, PeerSpec
from coordinator.planner import (
    Plan,
    _assign_value,
    _Layout,
    _rate_matrix,
    _repair,
    _resplit,
    _stage_times,
    _to_plan,
    _value,
    _water_fill,
    plan,
)

__all__ = ["DEFAULT_MIN_GAIN", "PlanHealth", "diagnose", "moved_peers", "rebalance"]

DEFAULT_MIN_GAIN = 0.05
"""A reshuffle must predict at least 5% more throughput than the best less disruptive option."""


@dataclass(frozen=True)
class PlanHealth:
    """A plan seen against the peers that are alive now.

    ``uncovered``: indices of stages no live peer can serve. ``bottleneck``: the slowest covered
    stage (``None`` if none is covered). ``stage_times`` has ``inf`` for uncovered stages, and
    ``throughput`` is 0 while anything is uncovered.
    """

    uncovered: tuple[int, ...]
    bottleneck: int | None
    stage_times: tuple[float, ...]
    throughput: float


def _surviving_layout(cm: CostModel, current: Plan) -> tuple[_Layout, dict[str, tuple[int, int]]]:
    """The current blocks with only the live peers that can still hold them."""
    bounds = [0] + [s.layer_end for s in current.stages]
    groups, kept = [], {}
    for s in current.stages:
        need = cm.block_memory(s.layer_start, s.layer_end)
        group = [cm.index[pid] for pid in s.peer_ids if pid in cm.index and cm.memory[cm.index[pid]] >= need]
        groups.append(group)
        kept.update({cm.peers[p].peer_id: (s.layer_start, s.layer_end) for p in group})
    return _Layout(bounds, groups), kept


def diagnose(current: Plan, peers: Sequence[PeerSpec], model: ModelSpec) -> PlanHealth:
    """Which blocks lost all their peers and which stage limits throughput, for the live ``peers``."""
    if current.n_layers != model.n_layers:
        raise ValueError(f"plan covers {current.n_layers} layers, model has {model.n_layers}")
    cm = CostModel(peers, model)
    lay, _ = _surviving_layout(cm, current)
    times = _stage_times(cm, lay)
    uncovered = tuple(i for i, g in enumerate(lay.groups) if not g)
    covered = [i for i in range(len(times)) if i not in uncovered]
    bottleneck = max(covered, key=lambda i: times[i]) if covered else None
    worst = max(times, default=math.inf)
    return PlanHealth(uncovered, bottleneck, tuple(times), 0.0 if uncovered or math.isinf(worst) else 1.0 / worst)


def moved_peers(old: Plan, new: Plan) -> frozenset[str]:
    """Peers that held a block in ``old`` and hold a different one (or none) in ``new``.

    Peers absent from ``old`` (newcomers, previously unused) are not moves: nobody is disturbed.
    """
    before, after = old.assignment(), new.assignment()
    present = set(after) | set(new.unused_peer_ids)
    return frozenset(pid for pid, block in before.items() if pid in present and after.get(pid) != block)


@dataclass
class _Candidate:
    name: str
    lay: _Layout
    value: float
    moved: int
    placed: int  # idle peers given a block


def rebalance(
    current: Plan,
    peers: Sequence[PeerSpec],
    model: ModelSpec,
    *,
    min_gain: float = DEFAULT_MIN_GAIN,
    replicas: bool = True,
) -> Plan | None:
    """The plan to switch to now that the live peers are ``peers``, or ``None`` to keep the current one.

    ``None`` means no live peer's block changes and no idle peer is placed; departed peers are
    simply dropped (``diagnose`` gives the updated prediction). ``min_gain`` is the hysteresis
    described in the module docstring. Raises ``InfeasiblePlanError`` if a block is uncovered and
    no plan can cover it.
    """
    if current.n_layers != model.n_layers:
        raise ValueError(f"plan covers {current.n_layers} layers, model has {model.n_layers}")
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    cm = CostModel(peers, model)
    if cm.n_peers == 0:
        raise InfeasiblePlanError("no peers left: every block is uncovered")
    base, kept = _surviving_layout(cm, current)
    old_blocks = current.assignment()
    idle = [i for i, p in enumerate(cm.peers) if p.peer_id not in kept]

    def make(name: str, lay: _Layout) -> _Candidate | None:
        if any(not g for g in lay.groups):
            return None
        value = _value(cm, lay)
        if math.isinf(value):
            return None
        blocks = {cm.peers[p].peer_id: (lay.bounds[j], lay.bounds[j + 1]) for j, g in enumerate(lay.groups) for p in g}
        moved = sum(1 for pid, block in old_blocks.items() if pid in cm.index and blocks.get(pid) != block)
        placed = sum(1 for p in idle if cm.peers[p].peer_id in blocks and cm.peers[p].peer_id not in old_blocks)
        return _Candidate(name, lay, value, moved, placed)

    def with_spares(lay: _Layout) -> _Layout:
        if not replicas or not all(lay.groups):
            return lay
        used = {p for g in lay.groups for p in g}
        return _water_fill(cm, lay, [p for p in idle if p not in used])[0]

    cands: list[_Candidate | None] = [make("keep", base)]
    filled = with_spares(_fill_uncovered(cm, base, idle))
    cands.append(make("fill", filled))
    if replicas:
        cands.append(make("steal", _steal_for_uncovered(cm, filled)))
    merged = _merge_uncovered(cm, filled)
    if merged is not None:
        cands.append(make("merge", _resplit(cm, with_spares(merged))))
    covered = [c for c in cands if c is not None]
    if covered:
        start = min(covered, key=lambda c: (c.moved, c.value)).lay
        cands.append(make("resplit", _resplit(cm, start)))
        if replicas:
            cands.append(make("move-one", _move_one_to_bottleneck(cm, start)))
            _, lay = _assign_value(cm, start.bounds)
            if lay is not None:
                cands.append(make("reassign", with_spares(lay)))
    try:
        fresh = plan(peers, model, replicas=replicas)
    except InfeasiblePlanError:
        fresh = None
    if fresh is not None:
        bounds = [0] + [s.layer_end for s in fresh.stages]
        cands.append(make("replan", _Layout(bounds, [[cm.index[pid] for pid in s.peer_ids] for s in fresh.stages])))
    valid = [c for c in cands if c is not None and (replicas or all(len(g) == 1 for g in c.lay.groups))]
    if not valid:
        raise InfeasiblePlanError("a block is uncovered and the live peers cannot cover every layer")
    chosen = _choose(valid, min_gain)
    unchanged = chosen.lay.bounds == base.bounds and all(
        sorted(a) == sorted(b) for a, b in zip(chosen.lay.groups, base.groups, strict=True)
    )
    return None if unchanged else _to_plan(cm, chosen.lay)


def _choose(valid: list[_Candidate], min_gain: float) -> _Candidate:
    """Least disruption first; more disruption only for more than ``min_gain`` more throughput
    (strictly more, so equal predictions always keep the plan that moves fewer peers)."""
    valid.sort(key=lambda c: (c.moved, c.value, -c.placed))
    chosen = valid[0]
    for c in valid[1:]:
        if c.moved > chosen.moved and chosen.value > c.value * (1.0 + min_gain) * (1.0 + 1e-9):
            chosen = c
    return chosen


# ------------------------------------------------------------------------------------------
# Candidate moves


def _fill_uncovered(cm: CostModel, lay: _Layout, idle: list[int]) -> _Layout:
    """Idle peers take uncovered blocks: the hardest block to fill first, its fastest fitting peer."""
    lay = lay.copy()
    free = list(idle)
    empty = [j for j, g in enumerate(lay.groups) if not g]
    while empty and free:
        options = []
        for j in empty:
            t = cm.block_times(np.asarray(free, dtype=np.int64), lay.bounds[j], lay.bounds[j + 1])
            options.append((int(np.isfinite(t).sum()), j, t))
        count, j, t = min(options, key=lambda o: o[:2])
        empty.remove(j)
        if count == 0:
            continue
        p = free.pop(int(np.argmin(t)))
        lay.groups[j].append(p)
    return lay


def _steal_for_uncovered(cm: CostModel, lay: _Layout) -> _Layout:
    """Each uncovered block takes the replica (from a stage with several) that leaves both
    stages fastest."""
    lay = lay.copy()
    rate = _rate_matrix(cm, lay.bounds)
    for j in [j for j, g in enumerate(lay.groups) if not g]:
        best, pick = 0.0, None
        for d, group in enumerate(lay.groups):
            if len(group) < 2:
                continue
            total = sum(rate[q, d] for q in group)
            for p in group:
                score = min(rate[p, j], total - rate[p, d])
                if score > best:
                    best, pick = score, (d, p)
        if pick is not None:
            d, p = pick
            lay.groups[d].remove(p)
            lay.groups[j].append(p)
    return lay


def _merge_uncovered(cm: CostModel, lay: _Layout) -> _Layout | None:
    """Drop uncovered stages, giving their layers to a neighbour, then re-split for memory and speed."""
    keep = [j for j, g in enumerate(lay.groups) if g]
    if not keep or len(keep) == len(lay.groups):
        return None
    # A stage now spans from its own start to the start of the next kept stage (the last to L).
    starts = [0] + [lay.bounds[j] for j in keep[1:]]
    merged = _Layout([*starts, cm.n_layers], [list(lay.groups[j]) for j in keep])
    return _resplit(cm, merged, window=cm.n_layers)


def _move_one_to_bottleneck(cm: CostModel, lay: _Layout) -> _Layout:
    """The single replica move (or swap) into the slowest stage that raises throughput most."""
    rate = _rate_matrix(cm, lay.bounds)
    where = np.full(cm.n_peers, -1, dtype=np.int64)
    for j, g in enumerate(lay.groups):
        where[g] = j
    total = np.array([rate[g, j].sum() for j, g in enumerate(lay.groups)])
    _repair(rate, where, total, max_moves=1)
    return _Layout(list(lay.bounds), [np.flatnonzero(where == j).tolist() for j in range(len(lay.groups))])
