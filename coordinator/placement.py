"""Which peers hold which contiguous block of layers, in pipeline order: the rule the coordinator runs.

Pure functions of the peers' announced measurements (``PeerSpec``) and the run's cost model
(``ModelSpec``, see ``coordinator/cost_model.py``); no I/O, clocks or randomness, so the same swarm always
gets the same placement and a future ``ravn plan`` can ask about hypothetical peers. The steps:

1. **Noise.** Peers measure themselves for half a second, often all at once on a shared machine. Speeds
   within a factor ``SPEED_NOISE`` of the median, and link bandwidths within ``LINK_NOISE``, count as the
   median (``steady``).
2. **Chain and spares.** ``stages`` peers hold the chain (default: one per peer, at most one per layer);
   peers behind NAT always hold a chain block, then the fastest; the rest are spares.
3. **Order, then sizes.** For each candidate order of the chain that keeps two peers behind NAT apart
   (every such order while that is cheap, else fastest-first and by id, arranged by
   ``reachability.arrange``) an exact dynamic programme sizes the blocks to minimise the slowest stage,
   once freely and once among even splits (sizes differ by at most one layer).
4. **Stability.** Among peers equal within noise the even split wins unless the best free split (which
   then differs only through links and memory) predicts more than ``MIN_GAIN_OVER_EVEN`` more throughput
   (Petals likewise moves blocks only past a balance threshold); peers that differ beyond noise get the
   free optimum, so a truly faster peer is never held back by the margin.
5. **Replicas.** Each spare, fastest first, joins the stage predicted slowest (or ``replicate``); the
   first stage holds the data source and is never replicated.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from coordinator.cost_model import CostModel, ModelSpec, PeerSpec
from coordinator.reachability import Unarrangeable, arrange, conflicts

__all__ = [
    "MIN_GAIN_OVER_EVEN",
    "LINK_NOISE",
    "SPEED_NOISE",
    "BadReplicas",
    "Block",
    "NoFit",
    "NoPeers",
    "Placement",
    "PlacementError",
    "TooManyStages",
    "Unarrangeable",
    "place",
    "steady",
]

# Speeds within this factor of the median are noise. CPU peers time themselves in CPU time
# (swarm/train/bench.py): identical peers measuring at once on 2 shared cores came out at most 1.47x apart
# over 4 runs (wall-clock timing: 2.7x); 1.75 covers that, and a peer 2x faster still gets a bigger block.
SPEED_NOISE = 1.75
LINK_NOISE = 3.0  # bandwidth probes to the coordinator spread 1.5x among identical loopback peers
MIN_GAIN_OVER_EVEN = 0.2  # among equal peers, an uneven split must predict >20% more throughput than the even one
_EXHAUSTIVE_BUDGET = 200_000  # DP steps (orders x peers x layers^2) up to which every peer order is tried


class PlacementError(ValueError):
    """No placement exists for these peers and this model; the message says why."""


class NoPeers(PlacementError):
    """There is nobody to place."""


class TooManyStages(PlacementError):
    """More pipeline stages were asked for than the model has layers (or a negative number)."""


class NoFit(PlacementError):
    """No contiguous split gives every stage a block its peers can hold in memory."""


class BadReplicas(PlacementError):
    """Spare peers cannot be placed as asked (the first stage, or a stage that does not exist)."""


@dataclass(frozen=True)
class Block:
    """Layers ``[layer_start, layer_end)`` held by ``peer_ids`` (the first is the chain peer, the rest
    replicas); ``time`` is the predicted seconds per micro-batch of the stage as a whole."""

    layer_start: int
    layer_end: int
    peer_ids: tuple[str, ...]
    time: float


@dataclass(frozen=True)
class Placement:
    """Blocks in pipeline order; ``even`` says whether the stable even split was kept."""

    blocks: tuple[Block, ...]
    even: bool

    @property
    def bottleneck(self) -> int:
        """Index of the slowest stage (the first of equals)."""
        return max(range(len(self.blocks)), key=lambda i: self.blocks[i].time)

    @property
    def bottleneck_time(self) -> float:
        return self.blocks[self.bottleneck].time

    @property
    def throughput(self) -> float:
        """Predicted micro-batches per second in steady state."""
        return 1.0 / self.bottleneck_time


def steady(peers: Sequence[PeerSpec], noise: float = SPEED_NOISE, link_noise: float = LINK_NOISE) -> list[PeerSpec]:
    """Speeds within a factor ``noise`` of the median, and bandwidths within ``link_noise``, become the median.

    A median-anchored band keeps one truly different peer (4x faster) apart while absorbing the spread of
    equals measured under contention; ``noise=1`` disables it.
    """

    def band(values: list[float], factor: float) -> list[float]:
        mid = statistics.median_high(values)
        return [mid if mid / factor <= v <= mid * factor else v for v in values]

    if not peers:
        return []
    link_noise = link_noise if noise > 1 else 1.0  # noise=1: no banding at all
    speed = band([p.speed for p in peers], noise)
    up = band([p.upload for p in peers], link_noise)
    down = band([p.download for p in peers], link_noise)
    return [replace(p, speed=s, upload=u, download=d) for p, s, u, d in zip(peers, speed, up, down, strict=True)]


def place(
    peers: Sequence[PeerSpec],
    model: ModelSpec,
    *,
    stages: int = 0,
    replicate: int = -1,
    noise: float = SPEED_NOISE,
    margin: float = MIN_GAIN_OVER_EVEN,
) -> Placement:
    """The placement of ``peers`` for ``model``: ``stages`` chain blocks (0: one per peer, at most one per
    layer), spares as replicas of the slowest stage or of stage ``replicate`` (-1: the slowest)."""
    if not peers:
        raise NoPeers("no peers to place")
    n_layers = model.n_layers
    if stages < 0 or stages > n_layers:
        raise TooManyStages(f"{stages} stages for a model of {n_layers} layers: at most one stage per layer")
    peers = steady(peers, noise)
    cm = CostModel(peers, model)
    n = min(stages or len(peers), n_layers, len(peers))  # a re-plan may have fewer peers than stages
    by_rank = sorted(peers, key=lambda p: (p.reachable, -p.speed, p.peer_id))  # NAT first, then fastest
    chain, spares = by_rank[:n], by_rank[n:]
    if spares:
        if n == 1:
            raise BadReplicas(
                "with replicas the pipeline needs at least 2 stages (the first stage is never replicated)"
            )
        if replicate == 0:
            raise BadReplicas("the first stage holds the data source and cannot be replicated (--replicate >= 1)")
        if replicate >= n:
            raise BadReplicas(f"--replicate {replicate}: the pipeline has only stages 0..{n - 1}")
    free, even = _best_chain(cm, chain)
    if not math.isfinite(free[0]):
        per_layer = max(model.layer_memory)
        raise NoFit(
            f"no split of {n_layers} layers over {n} peers fits their memory (a layer needs up to {per_layer:.3g} "
            f"bytes; the peers have {', '.join(f'{p.peer_id} {p.free_memory:.3g}' for p in chain)})"
        )
    equals = len({p.speed for p in chain}) == 1  # within noise: only links and memory can favour a free split
    use_even = math.isfinite(even[0]) and even[0] <= free[0] * (1.0 + (margin if equals else 0.0))
    _, order, bounds = even if use_even else free
    groups = [[cm.index[p]] for p in order]
    blocks = list(itertools.pairwise(bounds))
    spare_order = [cm.index[p.peer_id] for p in sorted(spares, key=lambda p: (-p.speed, p.peer_id))]
    _add_replicas(cm, blocks, groups, spare_order, replicate)
    return Placement(
        blocks=tuple(
            Block(a, b, tuple(cm.peers[i].peer_id for i in g), cm.stage_time(g, a, b))
            for (a, b), g in zip(blocks, groups, strict=True)
        ),
        even=use_even,
    )


def _add_replicas(
    cm: CostModel, blocks: list[tuple[int, int]], groups: list[list[int]], spares: list[int], target: int
) -> None:
    """Each spare, in turn, joins stage ``target`` (>= 1), or the slowest stage after the first it can hold."""
    starts, ends = np.array([a for a, _ in blocks]), np.array([b for _, b in blocks])
    rate = np.array([1.0 / cm.stage_time(g, a, b) for g, (a, b) in zip(groups, blocks, strict=True)])
    for p in spares:
        own = 1.0 / cm.times(p, starts, ends)  # 0 where p cannot hold the block
        fits = own > 0
        fits[0] = False  # the first stage holds the data source
        if target > 0:
            fits &= np.arange(len(blocks)) == target
        if not fits.any():
            where = f"stage {target}" if target > 0 else "any stage after the first"
            raise NoFit(f"spare peer {cm.peers[p].peer_id} cannot hold the block of {where} in memory")
        slowest = int(np.argmin(np.where(fits, rate, np.inf)))
        groups[slowest].append(p)
        rate[slowest] += own[slowest]


Candidate = tuple[float, list[str], list[int]]  # (bottleneck seconds, peer ids in order, block bounds)


def _best_chain(cm: CostModel, chain: list[PeerSpec]) -> tuple[Candidate, Candidate]:
    """The best free split and the best even split over the candidate orders (first found among equals)."""
    n, n_layers = len(chain), cm.n_layers
    reachable = {p.peer_id: p.reachable for p in chain}
    base = [p.peer_id for p in sorted(chain, key=lambda p: (-p.speed, p.peer_id))]
    arrange(base, reachable)  # raises Unarrangeable, with its explanation, when no order can work
    if math.factorial(n) * n * n_layers**2 <= _EXHAUSTIVE_BUDGET:
        orders = [list(o) for o in itertools.permutations(base) if not conflicts(o, reachable)]
    else:
        orders = [arrange(base, reachable), arrange(sorted(base), reachable)]
    table = {p: _time_table(cm, cm.index[p]) for p in base}
    q = n_layers // n
    free: Candidate = (math.inf, base, [])
    even: Candidate = (math.inf, base, [])
    for order in orders:
        times = [table[p] for p in order]
        t, bounds = _split(times, n_layers, 1, n_layers - n + 1)
        if t < free[0] * (1 - 1e-12):
            free = (t, order, bounds)
        t, bounds = _split(times, n_layers, q, q + 1)
        if t < even[0] * (1 - 1e-12):
            even = (t, order, bounds)
    return free, even


def _time_table(cm: CostModel, p: int) -> list[list[float]]:
    """``table[a][b]``: peer ``p``'s seconds per micro-batch for block ``[a, b)`` (inf where it does not fit)."""
    span = np.arange(cm.n_layers + 1)
    return cm.times(p, span[:, None], span[None, :]).tolist()


def _split(times: list[list[list[float]]], n_layers: int, lo: int, hi: int) -> tuple[float, list[int]]:
    """Exact min-max split of ``[0, n_layers)`` into ``len(times)`` blocks of ``lo..hi`` layers, the k-th
    held by the peer whose table is ``times[k]``: O(peers x layers^2)."""
    n = len(times)
    inf = math.inf
    cost = [[inf] * (n_layers + 1) for _ in range(n + 1)]  # cost[k][e]: the first k peers hold [0, e)
    cut = [[0] * (n_layers + 1) for _ in range(n + 1)]
    cost[0][0] = 0.0
    for k in range(1, n + 1):
        row = times[k - 1]
        for e in range(k * lo, min(k * hi, n_layers) + 1):
            for s in range(max(e - hi, 0), e - lo + 1):
                if cost[k - 1][s] == inf:
                    continue
                t = max(cost[k - 1][s], row[s][e])
                if t < cost[k][e]:
                    cost[k][e], cut[k][e] = t, s
    if cost[n][n_layers] == inf:
        return inf, []
    bounds, e = [n_layers], n_layers
    for k in range(n, 0, -1):
        e = cut[k][e]
        bounds.append(e)
    return cost[n][n_layers], bounds[::-1]
