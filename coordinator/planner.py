"""Partition planner: which contiguous block of layers each peer holds.

The objective is the pipeline's steady-state throughput, i.e. the slowest stage's time per
micro-batch (cost model in ``coordinator.cost_model``). Choosing blocks and peers together is
NP-hard for arbitrary per-layer costs and heterogeneous peers, so the planner is built from
pieces that are each exact for what they decide, and combined by bisection:

1. **Bisection on the bottleneck time T.** For a candidate T a feasibility check builds a plan in
   which every stage is at most T, or reports that it cannot.
2. **One peer per block** (``_solo_check``): a peer's *reach* from position x is the furthest block
   end it can serve within T. Stages are built left to right, each taken by the unused peer that
   reaches furthest, with the first and last stage (which skip one boundary's transfers) given to
   the peers that gain most from those slots. For identical layers this is exact: a middle peer's
   reach is a fixed layer count, so feasibility is "sum of the best capacities >= L".
3. **Replicas** (``_run_check``): peers sorted by memory form runs; each run is one stage's replica
   set, and each stage is made as long as the run's smallest memory and summed rates allow.
   Merging replicas is never worse than splitting them into more stages (it saves a boundary
   hop), so stages are as long as memory lets them be.
4. **Polish.** Unused peers become replicas of the most loaded stage they fit (water-filling the
   bottleneck); stage boundaries are then re-optimised exactly for the fixed replica sets by a
   min-max dynamic programme; small instances also get a hill-climb over single-peer moves.

The best candidate wins. See docs/planner.md for the cost model, complexity and measurements.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.cost_model import CostModel, InfeasiblePlanError, ModelSpec, PeerSpec

__all__ = ["Plan", "Stage", "evaluate_plan", "plan"]

# Upper end of the time search when only memory matters: finite, so inf (does not fit) stays above it.
_MEMORY_ONLY = 1e300
# Local search re-solves the split for every neighbour; it pays only on small instances.
_LOCAL_SEARCH_MAX_PEERS = 24
_LOCAL_SEARCH_MAX_LAYERS = 40
_LOCAL_SEARCH_ROUNDS = 60
# Budget (peer x block pairs) for the exact split re-optimisation before it narrows its window.
_SPLIT_BUDGET = 400_000


@dataclass(frozen=True)
class Stage:
    """Layers ``[layer_start, layer_end)`` held by every peer in ``peer_ids`` (replicas).

    ``time`` is the predicted seconds per micro-batch for the stage as a whole: replicas share
    micro-batches, so it is ``1 / sum(1 / t_p)``.
    """

    layer_start: int
    layer_end: int
    peer_ids: tuple[str, ...]
    time: float


@dataclass(frozen=True)
class Plan:
    """Stages in pipeline order, covering every layer exactly once.

    ``throughput`` is micro-batches per second (``1 / bottleneck_time``); ``unused_peer_ids`` are
    peers the plan could not give any block (too little memory for every block).
    """

    stages: tuple[Stage, ...]
    bottleneck_time: float
    throughput: float
    unused_peer_ids: tuple[str, ...] = ()

    @property
    def n_layers(self) -> int:
        return self.stages[-1].layer_end if self.stages else 0

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda i: self.stages[i].time)

    def stage_of(self, peer_id: str) -> int | None:
        """Index of the stage ``peer_id`` serves, or ``None`` if it serves none."""
        for i, st in enumerate(self.stages):
            if peer_id in st.peer_ids:
                return i
        return None

    def assignment(self) -> dict[str, tuple[int, int]]:
        """Peer id -> its block, the form a coordinator turns into Assignment messages."""
        return {pid: (st.layer_start, st.layer_end) for st in self.stages for pid in st.peer_ids}


@dataclass
class _Layout:
    """Planner-internal plan: ``bounds`` has one more entry than ``groups`` (peer indices)."""

    bounds: list[int]
    groups: list[list[int]]

    def copy(self) -> _Layout:
        return _Layout(list(self.bounds), [list(g) for g in self.groups])


# ---------------------------------------------------------------------------------------------
# Evaluation


def _group_time(cm: CostModel, group: Sequence[int], a: int, b: int) -> float:
    """Stage time with every replica required to fit (one that cannot hold the block voids it)."""
    if not group:
        return math.inf
    t = cm.block_times(np.asarray(group, dtype=np.int64), a, b)
    if not np.all(np.isfinite(t)):
        return math.inf
    return float(1.0 / np.sum(1.0 / t))


def _stage_times(cm: CostModel, lay: _Layout) -> list[float]:
    return [_group_time(cm, g, lay.bounds[i], lay.bounds[i + 1]) for i, g in enumerate(lay.groups)]


def _value(cm: CostModel, lay: _Layout) -> float:
    return max(_stage_times(cm, lay), default=math.inf)


def _to_plan(cm: CostModel, lay: _Layout) -> Plan:
    times = _stage_times(cm, lay)
    used = {p for g in lay.groups for p in g}
    stages = tuple(
        Stage(lay.bounds[i], lay.bounds[i + 1], tuple(cm.peers[p].peer_id for p in g), times[i])
        for i, g in enumerate(lay.groups)
    )
    bottleneck = max(times)
    unused = tuple(p.peer_id for i, p in enumerate(cm.peers) if i not in used)
    return Plan(stages, bottleneck, 0.0 if math.isinf(bottleneck) else 1.0 / bottleneck, unused)


def evaluate_plan(
    stages: Sequence[tuple[int, int, Sequence[str]]], peers: Sequence[PeerSpec], model: ModelSpec
) -> Plan:
    """Predict an explicit assignment, e.g. one the coordinator is running or one a test built.

    Raises ``ValueError`` if the blocks do not tile ``[0, L)`` or a peer is unknown, repeated, or
    cannot hold its block; a stage with no peers gets time ``inf`` (throughput 0).
    """
    cm = CostModel(peers, model)
    bounds = [0]
    groups: list[list[int]] = []
    seen: set[str] = set()
    for start, end, ids in stages:
        if start != bounds[-1] or end <= start:
            raise ValueError(f"stage [{start}, {end}) does not continue the tiling at {bounds[-1]}")
        group = []
        for pid in ids:
            if pid not in cm.index:
                raise ValueError(f"unknown peer {pid!r}")
            if pid in seen:
                raise ValueError(f"peer {pid!r} appears in two stages")
            seen.add(pid)
            if cm.memory[cm.index[pid]] < cm.block_memory(start, end):
                raise ValueError(f"peer {pid!r} cannot hold layers [{start}, {end})")
            group.append(cm.index[pid])
        bounds.append(end)
        groups.append(group)
    if bounds[-1] != model.n_layers:
        raise ValueError(f"stages cover [0, {bounds[-1]}) of {model.n_layers} layers")
    return _to_plan(cm, _Layout(bounds, groups))


# ---------------------------------------------------------------------------------------------
# Feasibility checks for a bottleneck budget T


def _last_true(mask: np.ndarray) -> np.ndarray:
    """Per row, index of the last True (``-1`` if none)."""
    width = mask.shape[1]
    rev = np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), width - 1 - rev, -1)


def _top(values: np.ndarray, valid: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` largest valid values, largest first (stable on ties)."""
    pos = np.flatnonzero(valid)
    if pos.size > k:
        pos = pos[np.argpartition(-values[pos], k - 1)[:k]]
    return pos[np.argsort(-values[pos], kind="stable")]


def _solo_check(cm: CostModel, pool: np.ndarray, budget: float) -> _Layout | None:
    """A plan with one peer per stage and every stage within ``budget``, or ``None``.

    Why the slot choice is exact for identical layers: a middle peer's reach is ``x + k_p`` (its
    capacity), so any set of middle peers covers the sum of its capacities; the first and last
    slots add ``gain = k_first - k_mid`` (resp. last) on top, and the best distinct pair is among
    the top two of each gain list. Stages are then filled greedily by reach.
    """
    L = cm.n_layers
    if pool.size == 0:
        return None
    t_whole = cm.block_times(pool, 0, L)
    if np.any(t_whole <= budget):
        return _Layout([0, L], [[int(pool[np.argmin(t_whole)])]])
    if L == 1 or pool.size < 2:
        return None
    # First slot: furthest end b < L of [0, b); last slot: earliest start x > 0 of [x, L).
    first_end = _last_true(cm.times_from(pool, 0, 1, L - 1) <= budget) + 1  # 0: cannot be first
    ok_last = cm.times_to(pool, L, 1, L - 1) <= budget
    last_start = np.where(ok_last.any(axis=1), np.argmax(ok_last, axis=1) + 1, L)  # L: cannot be last
    if L >= 3:
        mid_cap = _last_true(cm.times_from(pool, 1, 2, L - 1) <= budget) + 1  # layers from position 1
    else:
        mid_cap = np.zeros(pool.size, dtype=np.int64)
    can_first, can_last = first_end >= 1, last_start < L
    if not can_first.any() or not can_last.any():
        return None
    # Identical layers need only the top two of each gain list (see above); otherwise position
    # matters and a few more slot pairs are worth trying.
    width = 2 if cm.uniform else (6 if pool.size <= 64 else 3)
    gain_f = (first_end - mid_cap).astype(np.float64)
    gain_l = (L - last_start - mid_cap).astype(np.float64)
    firsts = _top(gain_f * (L + 1) + first_end, can_first, width)
    lasts = _top(gain_l * (L + 1) + (L - last_start), can_last, width)
    pairs = sorted(
        ((f, la) for f in firsts.tolist() for la in lasts.tolist() if f != la),
        key=lambda fl: -(gain_f[fl[0]] + gain_l[fl[1]]),
    )
    if pool.size <= 2 * L + 8:
        middles = np.flatnonzero(mid_cap >= 1) if cm.uniform else np.arange(pool.size)
    else:
        middles = _top(mid_cap.astype(np.float64), mid_cap >= 1, L + 2)
    for f, last in pairs:
        mids = middles[(middles != f) & (middles != last)]
        lay = _solo_fill(cm, budget, int(pool[f]), int(first_end[f]), int(pool[last]), pool[mids])
        if lay is not None:
            return lay
    return None


def _solo_fill(
    cm: CostModel, budget: float, first: int, first_end: int, last: int, mids: np.ndarray
) -> _Layout | None:
    """Left-to-right fill between a fixed first and a reserved last peer, furthest reach first."""
    L = cm.n_layers
    bounds, groups = [0, first_end], [[first]]
    avail = mids.copy()
    x = first_end
    while True:
        if cm.block_times(np.array([last]), x, L)[0] <= budget:
            return _Layout([*bounds, L], [*groups, [last]])
        if avail.size:
            t_fin = cm.block_times(avail, x, L)
            if np.any(t_fin <= budget):
                return _Layout([*bounds, L], [*groups, [int(avail[np.argmin(t_fin)])]])
        if x >= L - 1 or avail.size == 0:
            return None
        reach = _last_true(cm.times_from(avail, x, x + 1, L - 1) <= budget)
        pick = int(np.argmax(reach))
        if reach[pick] < 0:
            return None
        x = x + 1 + int(reach[pick])
        bounds.append(x)
        groups.append([int(avail[pick])])
        avail = np.delete(avail, pick)


def _run_check(cm: CostModel, order: np.ndarray, budget: float) -> _Layout | None:
    """A replicated plan within ``budget`` whose stages take consecutive runs of ``order``.

    ``order`` is by memory, largest first, so a run's memory limit is its last peer's. Each stage
    is the longest block some run starting at the next unused peer can serve within ``budget``,
    using the shortest such run.
    """
    L, n = cm.n_layers, order.size
    bounds, groups = [0], []
    x = i = 0
    while x < L:
        if i >= n:
            return None
        width = min(n - i, 64)
        while True:
            idx = order[i : i + width]
            with np.errstate(divide="ignore"):
                cover = np.cumsum(budget / cm.times_from(idx, x, x + 1, L), axis=0)
            reached = _last_true(cover[-1:] >= 1.0)[0]  # offset of the furthest coverable end
            best_end = x + 1 + reached if reached >= 0 else x
            more = i + width < n and best_end < L
            if more and cm.memory[order[i + width]] >= cm.block_memory(x, best_end + 1):
                width = min(n - i, 2 * width)
                continue
            break
        if reached < 0:
            return None
        run = int(np.argmax(cover[:, reached] >= 1.0)) + 1
        groups.append([int(p) for p in idx[:run]])
        bounds.append(best_end)
        i += run
        x = best_end
    return _Layout(bounds, groups)


def _bisect(
    cm: CostModel, check: Callable[[float], _Layout | None], lo: float, best: _Layout, rel_tol: float
) -> _Layout:
    """Smallest budget the check meets, narrowing ``[lo, hi]`` until ``rel_tol``.

    ``hi`` is always the actual bottleneck of the best plan found, so it snaps to real stage times
    rather than to bisection midpoints.
    """
    hi = _value(cm, best)
    for _ in range(200):
        if hi - lo <= rel_tol * hi:
            break
        mid = math.sqrt(lo * hi) if hi > 4.0 * lo else 0.5 * (lo + hi)
        lay = check(mid)
        if lay is None:
            lo = mid
            continue
        v = _value(cm, lay)
        if v < _value(cm, best):
            best = lay
        hi = min(mid, v)
    return best


# ---------------------------------------------------------------------------------------------
# Polish: water-fill spare peers, re-split exactly, hill-climb small instances


def _water_fill(cm: CostModel, lay: _Layout, spare: Sequence[int]) -> tuple[_Layout, list[int]]:
    """Each spare peer, fastest first, joins the most loaded stage it can hold."""
    if not spare or not lay.groups:
        return lay, list(spare)
    lay = lay.copy()
    extra = np.asarray(spare, dtype=np.int64)
    k = len(lay.groups)
    t = np.column_stack([cm.block_times(extra, lay.bounds[j], lay.bounds[j + 1]) for j in range(k)])
    fits = np.isfinite(t).tolist()
    t_list = t.tolist()
    rates = [0.0 if math.isinf(s) else 1.0 / s for s in _stage_times(cm, lay)]
    heap = [(-(1.0 / r if r > 0 else math.inf), j) for j, r in enumerate(rates)]
    heapq.heapify(heap)
    leftover: list[int] = []
    for e in np.argsort(-cm.speed[extra], kind="stable").tolist():
        popped = []
        while heap and not fits[e][heap[0][1]]:
            popped.append(heapq.heappop(heap))
        if heap:
            _, j = heapq.heappop(heap)
            lay.groups[j].append(int(extra[e]))
            rates[j] += 1.0 / t_list[e][j]
            heapq.heappush(heap, (-1.0 / rates[j], j))
        else:
            leftover.append(int(extra[e]))
        for item in popped:
            heapq.heappush(heap, item)
    return lay, leftover


def _split_dp(cm: CostModel, groups: list[list[int]], allowed: list[list[int]]) -> tuple[list[int], float]:
    """Boundaries minimising the slowest stage for fixed replica sets, boundary j from ``allowed[j]``."""
    k = len(groups)
    best = {0: (0.0, -1)}
    back: list[dict[int, tuple[float, int]]] = [best]
    for j in range(k):
        nxt: dict[int, tuple[float, int]] = {}
        g = np.asarray(groups[j], dtype=np.int64)
        ends = np.asarray(allowed[j + 1])
        for a, (val, _) in back[-1].items():
            if math.isinf(val):
                continue
            ok_ends = ends[ends > a]
            if ok_ends.size == 0:
                continue
            t = cm.times_from(g, a, int(ok_ends[0]), int(ok_ends[-1]))[:, ok_ends - ok_ends[0]]
            with np.errstate(divide="ignore"):
                st = np.where(np.isfinite(t).all(axis=0), 1.0 / np.sum(1.0 / t, axis=0), np.inf)
            for b, s in zip(ok_ends.tolist(), st.tolist(), strict=True):
                v = max(val, s)
                if b not in nxt or v < nxt[b][0]:
                    nxt[b] = (v, a)
        back.append(nxt)
    L = cm.n_layers
    if L not in back[-1]:
        return [], math.inf
    bounds = [L]
    for j in range(k, 0, -1):
        bounds.append(back[j][bounds[-1]][1])
    return bounds[::-1], back[-1][L][0]


def _resplit(cm: CostModel, lay: _Layout, window: int | None = None) -> _Layout:
    """Exactly re-optimise boundaries for fixed replica sets; keeps the input unless strictly better.

    With ``window`` each boundary moves at most that many layers, which keeps the cost bounded
    for thousands of peers; ``None`` searches every split.
    """
    k, L = len(lay.groups), cm.n_layers
    if k == 0 or k > L:
        return lay
    if window is None:
        n_peers = sum(len(g) for g in lay.groups)
        window = L
        while window > 1 and n_peers * (2 * window + 1) ** 2 > _SPLIT_BUDGET:
            window //= 2
    allowed = [[0]]
    for j in range(1, k):
        lo = max(j, lay.bounds[j] - window)
        hi = min(L - (k - j), lay.bounds[j] + window)
        allowed.append(list(range(lo, hi + 1)))
    allowed.append([L])
    bounds, val = _split_dp(cm, lay.groups, allowed)
    if bounds and val < _value(cm, lay) * (1.0 - 1e-12):
        return _Layout(bounds, [list(g) for g in lay.groups])
    return lay


def _even_bounds(L: int, k: int) -> list[int]:
    return [round(i * L / k) for i in range(k + 1)]


def _neighbours(lay: _Layout, unused: list[int], replicas: bool, L: int):
    """Single-peer edits of a layout; boundaries are re-solved by the caller."""
    k = len(lay.groups)
    g = lay.groups
    if replicas:
        for i in range(k):
            if len(g[i]) < 2:
                continue
            for p in g[i]:
                rest = [q for q in g[i] if q != p]
                for j in range(k):
                    if j != i:
                        new = [list(x) for x in g]
                        new[i], new[j] = rest, [*g[j], p]
                        yield new, unused
                if k < L:
                    for pos in (i, i + 1):
                        new = [list(x) for x in g]
                        new[i] = rest
                        new.insert(pos, [p])
                        yield new, unused
        for p in unused:
            for j in range(k):
                new = [list(x) for x in g]
                new[j] = [*g[j], p]
                yield new, [q for q in unused if q != p]
        for i in range(k - 1):
            yield [*g[:i], g[i] + g[i + 1], *g[i + 2 :]], unused
    else:
        for i in range(k):
            for j in range(i + 1, k):
                new = [list(x) for x in g]
                new[i], new[j] = g[j], g[i]
                yield new, unused
            for p in unused:
                new = [list(x) for x in g]
                new[i] = [p]
                yield new, [q for q in unused if q != p] + g[i]
        for i in range(k - 1):
            for keep, drop in ((g[i], g[i + 1]), (g[i + 1], g[i])):
                yield [*g[:i], keep, *g[i + 2 :]], unused + drop
        if k < L:
            for p in unused:
                for pos in range(k + 1):
                    new = [list(x) for x in g]
                    new.insert(pos, [p])
                    yield new, [q for q in unused if q != p]


def _local_search(cm: CostModel, lay: _Layout, unused: list[int], replicas: bool) -> tuple[_Layout, list[int]]:
    """First-improvement hill climb over single-peer edits, each scored with its optimal split."""
    L = cm.n_layers
    cur = _value(cm, lay)
    for _ in range(_LOCAL_SEARCH_ROUNDS):
        for groups, rest in _neighbours(lay, unused, replicas, L):
            k = len(groups)
            allowed = [[0]] + [list(range(j, L - (k - j) + 1)) for j in range(1, k)] + [[L]]
            bounds, val = _split_dp(cm, groups, allowed)
            if bounds and val < cur * (1.0 - 1e-12):
                lay, unused, cur = _Layout(bounds, groups), list(rest), val
                break
        else:
            break
    return lay, unused


def _polish(cm: CostModel, lay: _Layout, replicas: bool) -> _Layout:
    used = {p for g in lay.groups for p in g}
    unused = [p for p in range(cm.n_peers) if p not in used]
    for _ in range(3):
        before = _value(cm, lay)
        if replicas:
            lay, unused = _water_fill(cm, lay, unused)
        lay = _resplit(cm, lay)
        if _value(cm, lay) >= before * (1.0 - 1e-12):
            break
    if cm.n_peers <= _LOCAL_SEARCH_MAX_PEERS and cm.n_layers <= _LOCAL_SEARCH_MAX_LAYERS:
        lay, unused = _local_search(cm, lay, unused, replicas)
    if replicas and unused:
        lay, unused = _water_fill(cm, lay, unused)
    return lay


# ---------------------------------------------------------------------------------------------
# Entry point


def _check_inputs(cm: CostModel) -> None:
    if cm.n_peers == 0:
        raise InfeasiblePlanError("no peers: nothing can hold the model")
    need = max(cm.model.layer_memory)
    have = float(cm.memory.max())
    if need > have:
        layer = int(np.argmax(cm.model.layer_memory))
        raise InfeasiblePlanError(
            f"layer {layer} needs {need:.0f} bytes but the most free memory on any peer is {have:.0f}"
        )


def _solo_pool(cm: CostModel, replicas: bool) -> np.ndarray:
    """Peers the one-per-block search considers: all of them, or, when replicas will absorb the
    rest anyway, the fastest and the roomiest few (a pipeline never has more than L stages)."""
    everyone = np.arange(cm.n_peers)
    keep = 2 * cm.n_layers + 8
    if not replicas or cm.n_peers <= 2 * keep:
        return everyone
    one_layer = cm.block_times(everyone, 0, 1)
    fastest = np.argsort(one_layer, kind="stable")[:keep]
    roomiest = np.argsort(-cm.memory, kind="stable")[:keep]
    return np.unique(np.concatenate([fastest, roomiest]))


def plan(peers: Sequence[PeerSpec], model: ModelSpec, *, replicas: bool = True, rel_tol: float = 1e-9) -> Plan:
    """The plan with the smallest predicted bottleneck this planner finds.

    ``replicas=False`` gives every block exactly one peer (spare peers stay unused); for identical
    layers and boundaries that plan is optimal. With replicas (the default) spare peers serve as
    replicas and stages may hold several peers. Raises ``InfeasiblePlanError`` when there are no
    peers or their memory cannot cover every layer.
    """
    cm = CostModel(peers, model)
    _check_inputs(cm)
    everyone = np.arange(cm.n_peers)
    lower = float(cm.cost_cum[-1] / cm.speed.sum())  # all peers computing flat out, no transfers
    candidates: list[_Layout] = []

    pool = _solo_pool(cm, replicas)
    seed = _solo_check(cm, pool, _MEMORY_ONLY)
    if seed is None and pool.size < cm.n_peers:
        seed = _solo_check(cm, everyone, _MEMORY_ONLY)
        pool = everyone
    if seed is not None:
        candidates.append(_bisect(cm, lambda t: _solo_check(cm, pool, t), lower, seed, rel_tol))

    if replicas:
        order = np.lexsort((-cm.speed, -cm.memory))
        hi = _value(cm, candidates[0]) if candidates else _MEMORY_ONLY
        seed = _run_check(cm, order, hi)
        while seed is None and hi < _MEMORY_ONLY / 4:
            hi *= 4.0
            seed = _run_check(cm, order, hi)
        if seed is not None:
            candidates.append(_bisect(cm, lambda t: _run_check(cm, order, t), lower, seed, max(rel_tol, 1e-4)))

    if not candidates:
        raise InfeasiblePlanError(
            f"the peers' memory cannot cover all {cm.n_layers} layers "
            f"({cm.mem_cum[-1]:.0f} bytes needed, {cm.memory.sum():.0f} free in total across "
            f"{cm.n_peers} peers, each holding one contiguous block)"
        )
    polished = [_polish(cm, lay, replicas) for lay in candidates]
    return _to_plan(cm, min(polished, key=lambda lay: _value(cm, lay)))
