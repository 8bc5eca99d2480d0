"""Partition planner: which contiguous block of layers each peer holds.

The objective is the pipeline's steady-state throughput, i.e. the slowest stage's time per
micro-batch (cost model in ``coordinator.cost_model``). Choosing blocks and peers together is
NP-hard for arbitrary per-layer costs and heterogeneous peers, so the planner combines pieces
that are each exact, or classic, for the part they decide:

1. **Bisection on the bottleneck time T**, with two feasibility checks that build a plan whose
   every stage is within T:

   * *one peer per block* (``_solo_check``): a peer's reach from position x is the furthest block
     end it can serve within T; stages are filled left to right by the peer that reaches
     furthest, the first and last slots (which skip one boundary's transfers) going to the peers
     that gain most from them. For identical layers this is exact (see ``_solo_check``). With
     replicas allowed, a stage no single peer can serve takes the fewest peers that can;
   * *memory runs* (``_run_check``): peers sorted by memory form consecutive runs, one run per
     stage, each stage as long as its run's smallest memory and summed rates allow. Merging
     replicas never loses to splitting them into more stages (one boundary hop less), so stages
     should be as long as memory lets them be.

2. **Assignment and split descent** (replicas). For candidate partitions (the seeds', compute-
   balanced ones per depth, their mirror images; every partition when there are few), peers are
   assigned to blocks to maximise the slowest stage's rate (max-min greedy, and a covering
   bisection that exploits comparative advantage, both repaired by single moves and swaps);
   then boundaries are re-optimised exactly for those replica sets by a min-max DP, and the two
   steps alternate while either improves.

3. **Polish.** Spare peers become replicas of the most loaded stage they fit (water-filling the
   bottleneck), boundaries are re-split; small instances also get a hill-climb over single-peer
   moves and boundary moves.

The best candidate wins. Work is budgeted by instance size so 10,000 peers plan in well under a
second. See docs/planner.md for the cost model, complexity and measurements.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.cost_model import CostModel, InfeasiblePlanError, ModelSpec, PeerSpec

__all__ = ["Plan", "Stage", "evaluate_plan", "plan"]

# Upper end of the time search when only memory matters: finite, so inf (does not fit) stays above it.
_MEMORY_ONLY = 1e300
# Local search re-solves the split for every neighbour; it pays only on small instances
# (peers x layers up to this).
_LOCAL_SEARCH_MAX_SIZE = 128
_LOCAL_SEARCH_ROUNDS = 60
# Budget (peer x block pairs) for the exact split re-optimisation before it narrows its window.
_SPLIT_BUDGET = 1_000_000
# Every partition is scored when 2^(L-1) x peers stays under this (L <= 8 for a handful of peers).
_PARTITION_ENUM_BUDGET = 2_048
# The covering assignment costs about peers x stages^2 per check; above this only the greedy runs.
_COVER_BUDGET = 2_000_000
# With more peers than this per layer, replicas dominate and the one-per-block seed is skipped.
_CHAIN_MAX_PEERS_PER_LAYER = 4
# Peers x layers up to which every depth is tried and scored with the thorough assignment.
_SMALL_INSTANCE = 64
# Exact memory-only feasibility (DP over subsets) up to this many peers.
_MEMORY_DP_MAX_PEERS = 14
# Depths near the seeds' get a descent while peers x layers x depths stays under this.
_DEPTH_SWEEP_BUDGET = 200_000


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
        Stage(int(lay.bounds[i]), int(lay.bounds[i + 1]), tuple(cm.peers[p].peer_id for p in g), times[i])
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


def _solo_check(cm: CostModel, pool: np.ndarray, budget: float, groups_ok: bool = False) -> _Layout | None:
    """A plan with one peer per stage and every stage within ``budget``, or ``None``.

    Why the slot choice is exact for identical layers: a middle peer's reach is ``x + k_p`` (its
    capacity), so any set of middle peers covers the sum of its capacities; the first and last
    slots add ``gain = k_first - k_mid`` (resp. last) on top, and the best distinct pair is among
    the top two of each gain list. Stages are then filled greedily by reach.

    With ``groups_ok`` a stage no single peer can serve may take a small replica set instead
    (the fewest peers that reach furthest), so weak peers can still form a stage together.
    """
    L = cm.n_layers
    if pool.size == 0:
        return None
    t_whole = cm.block_times(pool, 0, L)
    if np.any(t_whole <= budget):
        return _Layout([0, L], [[int(pool[np.argmin(t_whole)])]])
    if L == 1 or pool.size < 2:
        return _chain_fill(cm, budget, None, 0, None, pool, groups_ok) if groups_ok else None
    # First slot: furthest end b < L of [0, b); last slot: earliest start x > 0 of [x, L).
    first_end = _last_true(cm.times_from(pool, 0, 1, L - 1) <= budget) + 1  # 0: cannot be first
    ok_last = cm.times_to(pool, L, 1, L - 1) <= budget
    last_start = np.where(ok_last.any(axis=1), np.argmax(ok_last, axis=1) + 1, L)  # L: cannot be last
    if L >= 3:
        mid_cap = _last_true(cm.times_from(pool, 1, 2, L - 1) <= budget) + 1  # layers from position 1
    else:
        mid_cap = np.zeros(pool.size, dtype=np.int64)
    can_first, can_last = first_end >= 1, last_start < L
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
    if cm.uniform:  # the best distinct pair decides feasibility; the others cannot do better
        pairs = pairs[:1]
    if groups_ok or (pool.size <= 2 * L + 8 and not cm.uniform):
        middles = np.arange(pool.size)
    elif pool.size <= 2 * L + 8:
        middles = np.flatnonzero(mid_cap >= 1)
    else:
        middles = _top(mid_cap.astype(np.float64), mid_cap >= 1, L + 2)
    for f, last in pairs:
        mids = middles[(middles != f) & (middles != last)]
        lay = _chain_fill(cm, budget, int(pool[f]), int(first_end[f]), int(pool[last]), pool[mids], groups_ok)
        if lay is not None:
            return lay
    if groups_ok:
        return _chain_fill(cm, budget, None, 0, None, pool, groups_ok)
    return None


def _chain_fill(
    cm: CostModel,
    budget: float,
    first: int | None,
    first_end: int,
    last: int | None,
    mids: np.ndarray,
    groups_ok: bool,
) -> _Layout | None:
    """Left-to-right fill between an optional first peer and an optional reserved last peer.

    Each step takes the single peer that reaches furthest; with ``groups_ok``, when nobody can
    serve even one layer alone, the fewest peers that together reach furthest.
    """
    L = cm.n_layers
    bounds, groups = ([0], []) if first is None else ([0, first_end], [[first]])
    x = 0 if first is None else first_end
    avail = mids.copy()
    while True:
        fin = _finish(cm, budget, x, last, avail, groups_ok)
        if fin is not None:
            return _Layout([*bounds, L], [*groups, fin])
        if x >= L - 1 or avail.size == 0:
            return None
        t = cm.times_from(avail, x, x + 1, L - 1)
        reach = _last_true(t <= budget)
        pick = int(np.argmax(reach))
        if reach[pick] >= 0:
            members, x = [pick], x + 1 + int(reach[pick])
        elif groups_ok:
            with np.errstate(divide="ignore"):
                cover = budget / t
            cum = np.cumsum(-np.sort(-cover, axis=0), axis=0)
            need = np.where(cum[-1] >= 1.0, np.argmax(cum >= 1.0, axis=0) + 1, avail.size + 1)
            fewest = int(need.min())
            if fewest > avail.size:
                return None
            off = int(np.flatnonzero(need == fewest)[-1])
            members = np.argsort(-cover[:, off], kind="stable")[:fewest].tolist()
            x = x + 1 + off
        else:
            return None
        bounds.append(x)
        groups.append([int(avail[m]) for m in members])
        avail = np.delete(avail, members)


def _finish(
    cm: CostModel, budget: float, x: int, last: int | None, avail: np.ndarray, groups_ok: bool
) -> list[int] | None:
    """Who can serve the final block ``[x, L)``: the reserved peer, another one, or (if allowed) a set."""
    L = cm.n_layers
    if last is not None and cm.block_times(np.array([last]), x, L)[0] <= budget:
        return [last]
    t = cm.block_times(avail, x, L) if avail.size else np.empty(0)
    if t.size and np.any(t <= budget):
        return [int(avail[np.argmin(t)])]
    if not groups_ok:
        return None
    cand = avail if last is None else np.append(avail, last)
    t = cm.block_times(cand, x, L)
    with np.errstate(divide="ignore"):
        cover = budget / t
    order = np.argsort(-cover, kind="stable")
    cum = np.cumsum(cover[order])
    if cum.size == 0 or cum[-1] < 1.0:
        return None
    return [int(c) for c in cand[order[: int(np.argmax(cum >= 1.0)) + 1]]]


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
        # Grow the run in doubling chunks only while a longer block could still fit its memory.
        chunks: list[np.ndarray] = []
        total = np.zeros(L - x)
        start, width = i, min(n - i, 64)
        while True:
            with np.errstate(divide="ignore"):
                chunk = budget / cm.times_from(order[start : start + width], x, x + 1, L)
            chunks.append(chunk)
            total += chunk.sum(axis=0)
            reached = int(_last_true((total >= 1.0)[None, :])[0])  # offset of the furthest coverable end
            best_end = x + 1 + reached if reached >= 0 else x
            start += width
            if start < n and best_end < L and cm.memory[order[start]] >= cm.block_memory(x, best_end + 1):
                width = min(n - start, 2 * width)
                continue
            break
        if reached < 0:
            return None
        run, acc = i, 0.0
        for chunk in chunks:
            col = chunk[:, reached]
            if acc + col.sum() >= 1.0:
                run += int(np.argmax(acc + np.cumsum(col) >= 1.0)) + 1
                break
            acc += col.sum()
            run += col.size
        groups.append(order[i:run].tolist())
        bounds.append(best_end)
        i, x = run, best_end
    return _Layout(bounds, groups)


def _memory_cover(cm: CostModel) -> _Layout | None:
    """Any one-peer-per-block plan that fits in memory, or ``None`` if there is none.

    Reach by memory alone is monotone in the start position, so for a set of peers only the
    furthest point they can cover together matters: a DP over subsets is exact, and cheap for a
    dozen peers. With more peers two greedy orders are tried: furthest reach first (few peers
    to spare) and smallest sufficient peer first (big layers need the big peers).
    """
    everyone = np.arange(cm.n_peers)
    lay = _solo_check(cm, everyone, _MEMORY_ONLY)
    if lay is not None:
        return lay
    if cm.n_peers <= _MEMORY_DP_MAX_PEERS:
        return _memory_dp(cm)
    return _best_fit_cover(cm)


def _memory_reach(cm: CostModel, p: int, x: int) -> int:
    """Furthest block end from ``x`` that peer ``p`` can hold (``x`` if not even one layer)."""
    return int(np.searchsorted(cm.mem_cum, cm.mem_cum[x] + cm.memory[p], side="right")) - 1


def _memory_dp(cm: CostModel) -> _Layout | None:
    L, n = cm.n_layers, cm.n_peers
    cum, mem = cm.mem_cum.tolist(), cm.memory.tolist()
    reach = {0: 0}  # subset bitmask -> furthest position covered
    back: dict[int, tuple[int, int]] = {}
    for mask in range(1 << n):  # supersets come later in numeric order
        if mask not in reach:
            continue
        x = reach[mask]
        if x >= L:
            bounds, groups = [L], []
            while mask:
                prev, p = back[mask]
                groups.append([p])
                bounds.append(reach[prev])
                mask = prev
            return _Layout(bounds[::-1], groups[::-1])
        for p in range(n):
            if mask >> p & 1:
                continue
            y = min(bisect.bisect_right(cum, cum[x] + mem[p]) - 1, L)
            nxt = mask | 1 << p
            if y > x and y > reach.get(nxt, -1):
                reach[nxt], back[nxt] = y, (mask, p)
    return None


def _best_fit_cover(cm: CostModel) -> _Layout | None:
    L = cm.n_layers
    free = sorted(range(cm.n_peers), key=lambda p: cm.memory[p])
    bounds, groups, x = [0], [], 0
    while x < L:
        need = cm.block_memory(x, x + 1)
        fit = next((p for p in free if cm.memory[p] >= need), None)
        if fit is None:
            return None
        free.remove(fit)
        x = min(_memory_reach(cm, fit, x), L)
        bounds.append(x)
        groups.append([fit])
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
    """Each spare peer, strongest first, joins the most loaded stage it can hold."""
    if not spare or not lay.groups:
        return lay, list(spare)
    lay = lay.copy()
    extra = np.asarray(spare, dtype=np.int64)
    k = len(lay.groups)
    with np.errstate(divide="ignore"):
        rate = 1.0 / np.column_stack([cm.block_times(extra, lay.bounds[j], lay.bounds[j + 1]) for j in range(k)])
    total = np.array([0.0 if math.isinf(t) else 1.0 / t for t in _stage_times(cm, lay)])
    where = np.full(extra.size, -1, dtype=np.int64)
    _fill_slowest(rate, where, total, np.argsort(-rate.max(axis=1), kind="stable"))
    for e, j in enumerate(where.tolist()):
        if j >= 0:
            lay.groups[j].append(int(extra[e]))
    return lay, extra[where < 0].tolist()


def _split_dp(cm: CostModel, groups: list[list[int]], allowed: list[list[int]]) -> tuple[list[int], float]:
    """Boundaries minimising the slowest stage for fixed replica sets, boundary j from ``allowed[j]``.

    ``val[j][b]`` is the best bottleneck of stages ``0..j-1`` ending at ``b``; each stage is one
    vectorised min-max over (start, end) pairs.
    """
    k = len(groups)
    val = np.zeros(1)
    back: list[np.ndarray] = []
    for j in range(k):
        starts, ends = np.asarray(allowed[j]), np.asarray(allowed[j + 1])
        t = cm.times_grid(np.asarray(groups[j], dtype=np.int64), starts, ends)
        with np.errstate(divide="ignore"):
            stage = np.where(np.isfinite(t).all(axis=0), 1.0 / np.sum(1.0 / t, axis=0), np.inf)
        cand = np.maximum(val[:, None], stage)  # (starts, ends)
        arg = np.argmin(cand, axis=0)
        val = cand[arg, np.arange(ends.size)]
        back.append(starts[arg])
    if not np.isfinite(val[0]):
        return [], math.inf
    bounds = [allowed[k][0]]
    for j in range(k - 1, -1, -1):
        b = bounds[-1]
        bounds.append(int(back[j][allowed[j + 1].index(b)]))
    return bounds[::-1], float(val[0])


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


def _balanced_bounds(cm: CostModel, k: int) -> list[int]:
    """``k`` blocks of about equal compute, every block non-empty."""
    L = cm.n_layers
    targets = cm.cost_cum[-1] * np.arange(1, k) / k
    cuts = np.searchsorted(cm.cost_cum, targets).tolist()
    bounds = [0]
    for j, c in enumerate(cuts, start=1):
        bounds.append(min(max(c, bounds[-1] + 1), L - (k - j)))
    return [*bounds, L]


def _mirror(bounds: Sequence[int], L: int) -> list[int]:
    return [L - b for b in reversed(bounds)]


def _assign_value(cm: CostModel, bounds: list[int], thorough: bool = True) -> tuple[float, _Layout | None]:
    groups = _assign(_rate_matrix(cm, bounds), thorough)
    if groups is None:
        return math.inf, None
    lay = _Layout(list(bounds), groups)
    return _value(cm, lay), lay


def _partition_neighbours(bounds: list[int], L: int):
    k = len(bounds) - 1
    for j in range(1, k):  # shift one boundary
        for d in (-1, 1):
            b = bounds[j] + d
            if bounds[j - 1] < b < bounds[j + 1]:
                yield [*bounds[:j], b, *bounds[j + 1 :]]
    for j in range(1, k):  # merge two neighbouring blocks
        yield [*bounds[:j], *bounds[j + 1 :]]
    for j in range(k):  # split one block
        for b in range(bounds[j] + 1, bounds[j + 1]):
            yield [*bounds[: j + 1], b, *bounds[j + 1 :]]


def _partition_search(cm: CostModel, lay: _Layout) -> _Layout:
    """Hill climb over block boundaries, each partition scored by its best replica assignment."""
    cur_val, cur = _value(cm, lay), lay
    for _ in range(_LOCAL_SEARCH_ROUNDS):
        for bounds in _partition_neighbours(cur.bounds, cm.n_layers):
            val, cand = _assign_value(cm, bounds)
            if cand is not None and val < cur_val * (1.0 - 1e-12):
                cur_val, cur = val, cand
                break
        else:
            break
    return cur


def _rate_matrix(cm: CostModel, bounds: Sequence[int]) -> np.ndarray:
    """Peer x stage rates (micro-batches/s); 0 where the peer cannot hold the block."""
    every = np.arange(cm.n_peers)
    t = np.column_stack([cm.block_times(every, bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)])
    return 1.0 / t


def _assign(rate: np.ndarray, thorough: bool = True) -> list[list[int]] | None:
    """Replica sets for fixed blocks that maximise the smallest stage rate.

    Two constructions, each followed by the same repair, and the better kept: the classic
    max-min greedy (strongest peer first, to the slowest stage it can hold), and, if
    ``thorough`` and the instance is small enough, a bisection on the stage time whose check
    covers the most constrained block first with the peers least useful elsewhere (it exploits
    comparative advantage, e.g. a peer with a slow uplink is worth most in the last stage).
    """
    n, k = rate.shape
    fits = rate > 0
    if not fits.any(axis=0).all():
        return None
    options = [_greedy_assign(rate)]
    if thorough and n * k * k <= _COVER_BUDGET:
        options.append(_cover_bisect(rate, options[0]))
    best, best_min = None, 0.0
    for where in options:
        if where is None:
            continue
        total = np.bincount(where[where >= 0], weights=rate[where >= 0, where[where >= 0]], minlength=k)
        _place_rest(rate, where, total)
        _repair(rate, where, total, swaps=thorough)
        if total.min() > best_min:
            best, best_min = where, float(total.min())
    if best is None:
        return None
    return [np.flatnonzero(best == j).tolist() for j in range(k)]


def _greedy_assign(rate: np.ndarray) -> np.ndarray:
    """Strongest peer first, each to the currently slowest stage it can hold."""
    where = np.full(rate.shape[0], -1, dtype=np.int64)
    _fill_slowest(rate, where, np.zeros(rate.shape[1]), np.argsort(-rate.max(axis=1), kind="stable"))
    return where


def _place_rest(rate: np.ndarray, where: np.ndarray, total: np.ndarray) -> None:
    """Unplaced peers, strongest first, join the slowest stage they can hold (in place)."""
    rest = np.flatnonzero(where < 0)
    _fill_slowest(rate, where, total, rest[np.argsort(-rate[rest].max(axis=1), kind="stable")])


def _fill_slowest(rate: np.ndarray, where: np.ndarray, total: np.ndarray, peers: np.ndarray) -> None:
    """Each of ``peers``, in order, joins the slowest stage it can hold (in place).

    Several empty stages tie at zero; the peer takes the one it serves best. Which stages a peer
    can hold depends only on memory, so with stages sorted by how many peers fit them the choices
    are prefixes, and the slowest one is an argmin over a prefix.
    """
    k = rate.shape[1]
    if peers.size == 0:
        return
    rows = rate[peers]
    fits = rows > 0
    st = np.argsort(-fits.sum(axis=0), kind="stable")
    rows, fits = rows[:, st], fits[:, st]
    count = fits.sum(axis=1)
    nested = bool((fits == (np.arange(k)[None, :] < count[:, None])).all())
    tot = total[st].astype(np.float64)
    for i, p in enumerate(peers.tolist()):
        c = int(count[i])
        if c == 0:
            continue
        if nested:
            j = int(tot[:c].argmin())
        else:
            j = int(np.where(fits[i], tot, np.inf).argmin())
        if tot[j] == 0.0:
            zero = np.flatnonzero((tot == 0.0) & fits[i])
            j = int(zero[np.argmax(rows[i, zero])])
        where[p] = st[j]
        tot[j] += rows[i, j]
    total[st] = tot


def _cover(cover: np.ndarray) -> np.ndarray | None:
    """Give every block replicas whose summed coverage (rate x budget) reaches 1, or ``None``.

    The block with the least coverage left among unplaced peers goes first. It takes peers by
    the ratio of their coverage here to their best coverage on another open block, except that
    once some peer can complete it, it takes the completer worth least elsewhere (best fit).
    Peers not needed stay unplaced (-1).
    """
    n, k = cover.shape
    where = np.full(n, -1, dtype=np.int64)
    free = np.arange(n)  # unplaced peers
    open_ = list(range(k))  # blocks still to cover
    while open_:
        sub = cover[np.ix_(free, open_)]
        supply = sub.sum(axis=0)
        c = int(np.argmin(supply))
        if supply[c] < 1.0:
            return None
        here = sub[:, c]
        elsewhere = np.delete(sub, c, axis=1).max(axis=1) if len(open_) > 1 else np.zeros(free.size)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(here > 0, here / elsewhere, -np.inf)
        pool = here > 0
        # Bulk step: take peers by ratio up to the first point where a remaining peer can complete.
        order = np.argsort(-ratio, kind="stable")[: int(pool.sum())]
        cum = np.concatenate(([0.0], np.cumsum(here[order])))
        rest_max = np.concatenate((np.maximum.accumulate(here[order][::-1])[::-1], [0.0]))
        bulk = int(np.argmax((1.0 - cum <= rest_max) | (cum >= 1.0)))
        members: list[int] = order[:bulk].tolist()
        got = float(cum[bulk])
        pool[members] = False
        while got < 1.0:
            completes = np.flatnonzero(pool & (here >= 1.0 - got))
            if completes.size:  # best fit: the completer worth least elsewhere
                m = int(completes[np.lexsort((here[completes], elsewhere[completes]))[0]])
            else:
                m = int(np.argmax(np.where(pool, ratio, -np.inf)))
            members.append(m)
            pool[m] = False
            got += float(here[m])
        where[free[members]] = open_[c]
        free = np.delete(free, members)
        del open_[c]
    return where


def _cover_bisect(rate: np.ndarray, start: np.ndarray) -> np.ndarray | None:
    """Smallest stage time (to 0.1%) for which ``_cover`` succeeds, searched below the greedy's."""
    k = rate.shape[1]
    placed = start >= 0
    base = np.bincount(start[placed], weights=rate[placed, start[placed]], minlength=k).min()
    hi = 1.0 / base if base > 0 else None
    lo = 1.0 / rate.sum(axis=0).min()  # every peer in the slowest block would still be this slow
    if hi is None:
        hi = lo * 1e6
    best = None
    for _ in range(40):
        if hi - lo <= 1e-3 * hi:
            break
        mid = 0.5 * (lo + hi)
        where = _cover(rate * mid)
        if where is None:
            lo = mid
        else:
            best, hi = where, mid
    return best


def _repair(
    rate: np.ndarray, where: np.ndarray, total: np.ndarray, max_moves: int = 10_000, swaps: bool = True
) -> None:
    """Local moves into the slowest stage while they raise the minimum rate (in place)."""
    n, k = rate.shape
    if k < 2:
        return
    count = np.bincount(where[where >= 0], minlength=k)
    for _ in range(max_moves):
        order = np.argsort(total, kind="stable")
        low = int(order[0])
        second, third = total[order[1]], total[order[2]] if k > 2 else np.inf
        movable = (where >= 0) & (where != low) & (rate[:, low] > 0)
        movable &= count[np.maximum(where, 0)] >= 2
        cand = np.flatnonzero(movable)
        best_gain, move = total[low], None
        if cand.size:
            d = where[cand]
            others = np.where(d == order[1], third, second)
            new_min = np.minimum(np.minimum(total[low] + rate[cand, low], total[d] - rate[cand, d]), others)
            i = int(np.argmax(new_min))
            if new_min[i] > best_gain * (1 + 1e-12):
                best_gain, move = new_min[i], ("move", int(cand[i]))
        unplaced = np.flatnonzero((where < 0) & (rate[:, low] > 0))
        if unplaced.size:
            i = int(unplaced[np.argmax(rate[unplaced, low])])
            if min(total[low] + rate[i, low], second) > best_gain * (1 + 1e-12):
                best_gain, move = min(total[low] + rate[i, low], second), ("add", i)
        if move is None and swaps and n <= 400:
            move = _best_swap(rate, where, total, low, order)
        if move is None:
            return
        kind, p = move[0], move[1]
        if kind == "swap":
            q = move[2]
            dq = where[q]
            total[low] += rate[q, low] - rate[p, low]
            total[dq] += rate[p, dq] - rate[q, dq]
            where[p], where[q] = dq, low
            continue
        if where[p] >= 0:
            total[where[p]] -= rate[p, where[p]]
            count[where[p]] -= 1
        where[p] = low
        total[low] += rate[p, low]
        count[low] += 1


def _best_swap(rate: np.ndarray, where: np.ndarray, total: np.ndarray, low: int, order: np.ndarray):
    """Best exchange of a peer in the slowest stage with one elsewhere, if it raises the minimum."""
    k = total.size
    inside = np.flatnonzero(where == low)
    outside = np.flatnonzero((where >= 0) & (where != low) & (rate[:, low] > 0))
    if inside.size == 0 or outside.size == 0:
        return None
    d = where[outside]
    # new rates: slowest stage gains q and loses p; q's stage gains p and loses q
    new_low = total[low] - rate[inside, low][:, None] + rate[outside, low][None, :]
    new_d = total[d][None, :] - rate[outside, d][None, :] + rate[inside[:, None], d[None, :]]
    ok = rate[inside[:, None], d[None, :]] > 0
    second = total[order[1]]
    third = total[order[2]] if k > 2 else np.inf
    others = np.where(d == order[1], third, second)[None, :]
    new_min = np.where(ok, np.minimum(np.minimum(new_low, new_d), others), -np.inf)
    i, j = np.unravel_index(int(np.argmax(new_min)), new_min.shape)
    if new_min[i, j] > total[low] * (1 + 1e-12):
        return ("swap", int(inside[i]), int(outside[j]))
    return None


def _alternate(cm: CostModel, lay: _Layout, rounds: int = 4) -> _Layout:
    """Block-coordinate descent from an assigned layout: best blocks for these replica sets, then
    best replica sets for those blocks, while either step strictly improves."""
    best = lay
    for _ in range(rounds):
        moved = _resplit(cm, best)
        if moved is best:
            break
        val, cand = _assign_value(cm, moved.bounds)
        step = cand if cand is not None and val < _value(cm, moved) else moved
        if _value(cm, step) >= _value(cm, best) * (1.0 - 1e-12):
            break
        best = step
    return best


def _neighbours(lay: _Layout, unused: list[int], replicas: bool, L: int):
    """Single-peer edits of a layout; boundaries are re-solved by the caller."""
    k = len(lay.groups)
    g = lay.groups
    for i in range(k):  # stage order matters at the ends, which skip one boundary's transfers
        for j in range(i + 1, k):
            new = [list(x) for x in g]
            new[i], new[j] = g[j], g[i]
            yield new, unused
    if replicas:
        for i in range(k):
            for p in g[i]:
                rest = [q for q in g[i] if q != p]
                for j in range(k):
                    if j != i:
                        new = [list(x) for x in g]
                        new[i], new[j] = rest, [*g[j], p]
                        yield [x for x in new if x], unused  # a peer leaving alone dissolves its stage
                if k < L and rest:
                    for pos in (i, i + 1):
                        new = [list(x) for x in g]
                        new[i] = rest
                        new.insert(pos, [p])
                        yield new, unused
        for p in unused:
            rest = [q for q in unused if q != p]
            for j in range(k):
                new = [list(x) for x in g]
                new[j] = [*g[j], p]
                yield new, rest
            if k < L:
                for pos in range(k + 1):
                    yield [*g[:pos], [p], *g[pos:]], rest
        for i in range(k - 1):
            yield [*g[:i], g[i] + g[i + 1], *g[i + 2 :]], unused
    else:
        for i in range(k):
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
    """Spare peers become replicas of the most loaded stage they fit, then boundaries re-balance."""
    used = {p for g in lay.groups for p in g}
    unused = [p for p in range(cm.n_peers) if p not in used]
    for _ in range(3):
        before = _value(cm, lay)
        if replicas:
            lay, unused = _water_fill(cm, lay, unused)
        lay = _resplit(cm, lay)
        if _value(cm, lay) >= before * (1.0 - 1e-12):
            break
    return lay


def _all_partitions(L: int):
    for mask in range(1 << (L - 1)):
        yield [0, *(b for b in range(1, L) if mask >> (b - 1) & 1), L]


def _descend_from_partitions(cm: CostModel, seeds: list[_Layout]) -> list[_Layout]:
    """Score candidate partitions by their best replica assignment; descend from the best few.

    Three regimes, by size. *Small* (a few peers and layers): every depth's compute-balanced
    partition and its mirror image (the two ends skip different transfers), every partition
    when there are few, all scored with the thorough assignment. *Medium*: depths within two of
    the seeds', scored by the greedy assignment, the best four refined. *Large* (the fluid
    regime, where the seeds' depths are already right): only the seeds' own partitions.
    """
    L, n = cm.n_layers, cm.n_peers
    floor = min(_value(cm, s) for s in seeds)
    seeds = [s for s in seeds if _value(cm, s) <= 1.5 * floor]
    if n * L <= _SMALL_INSTANCE:
        depths: Sequence[int] = range(1, min(n, L) + 1)
        keep, rounds = 4, 4
    elif n * L * min(n, L) <= _DEPTH_SWEEP_BUDGET:
        depths = sorted({len(s.groups) + d for s in seeds for d in (-2, -1, 0, 1, 2)} | {1})
        keep, rounds = 4, 3
    else:
        depths, keep, rounds = [], 1, 2
    starts = [s.bounds for s in seeds] + [_balanced_bounds(cm, k) for k in depths if 1 <= k <= min(n, L)]
    if depths:
        starts += [_mirror(b, L) for b in starts]
    if (1 << (L - 1)) * n <= _PARTITION_ENUM_BUDGET:
        starts += list(_all_partitions(L))
    unique = [b for b in {tuple(b): list(b) for b in starts}.values() if len(b) - 1 <= n]
    thorough = n * L <= _SMALL_INSTANCE
    scored = []
    for bounds in unique:
        val, lay = _assign_value(cm, bounds, thorough)
        if lay is not None:
            scored.append((val, lay))
    scored.sort(key=lambda vl: vl[0])
    best = []
    for _, lay in scored[:keep]:
        if not thorough:
            val, refined = _assign_value(cm, lay.bounds)
            if refined is not None and val < _value(cm, lay):
                lay = refined
        best.append(_alternate(cm, lay, rounds=rounds))
    return best


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
    keep = cm.n_layers + 4
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
    replicas and stages may hold several peers; a peer is left unused only if it can hold no
    block of the plan. ``rel_tol`` is the relative precision of the bisection on the bottleneck
    time. Raises ``InfeasiblePlanError`` when there are no peers or their memory cannot cover
    every layer.
    """
    cm = CostModel(peers, model)
    _check_inputs(cm)
    everyone = np.arange(cm.n_peers)
    lower = float(cm.cost_cum[-1] / cm.speed.sum())  # all peers computing flat out, no transfers
    candidates: list[_Layout] = []

    pool = _solo_pool(cm, replicas)
    seed = _solo_check(cm, pool, _MEMORY_ONLY)
    if seed is None:
        seed = _memory_cover(cm)
        pool = everyone
    if seed is not None and (not replicas or cm.n_peers <= _CHAIN_MAX_PEERS_PER_LAYER * cm.n_layers):
        check = lambda t: _solo_check(cm, pool, t, groups_ok=replicas)  # noqa: E731
        # With replicas this seed is refined later, so a coarser search is enough.
        candidates.append(_bisect(cm, check, lower, seed, rel_tol if not replicas else max(rel_tol, 1e-4)))
    elif seed is not None:
        candidates.append(seed)

    if replicas:
        order = np.lexsort((-cm.speed, -cm.memory))
        hi = _value(cm, candidates[0]) if candidates else _MEMORY_ONLY
        seed = _run_check(cm, order, hi)
        while seed is None and hi < _MEMORY_ONLY / 4:
            hi *= 4.0
            seed = _run_check(cm, order, hi)
        if seed is not None:
            candidates.append(_bisect(cm, lambda t: _run_check(cm, order, t), lower, seed, max(rel_tol, 5e-3)))

    if not candidates:
        raise InfeasiblePlanError(
            f"the peers' memory cannot cover all {cm.n_layers} layers "
            f"({cm.mem_cum[-1]:.0f} bytes needed, {cm.memory.sum():.0f} free in total across "
            f"{cm.n_peers} peers, each holding one contiguous block)"
        )
    candidates = [_polish(cm, lay, replicas) for lay in candidates]
    if replicas:
        candidates += [_polish(cm, lay, replicas) for lay in _descend_from_partitions(cm, candidates)]
    best = min(candidates, key=lambda lay: _value(cm, lay))
    if cm.n_peers * cm.n_layers <= _LOCAL_SEARCH_MAX_SIZE:
        used = {p for g in best.groups for p in g}
        best, _ = _local_search(cm, best, [p for p in range(cm.n_peers) if p not in used], replicas)
        if replicas:
            best = _partition_search(cm, best)
        best = _polish(cm, best, replicas)
    return _to_plan(cm, best)
