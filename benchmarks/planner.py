"""Benchmark the partition planner: planning time against swarm size, and plan quality.

Swarms are drawn from a mix of gaming GPUs (free memory, relative speed) on home links (a few to
a few hundred Mbit/s, upload slower than download), training a stack of identical blocks of a
d_model=2048 transformer: 0.9 GiB per layer held (weights, fp32 master copy, Adam, activations),
int8 activations and gradients of 2048 tokens (4 MiB) across every boundary. Times are the best
of ``--repeat`` runs on one pinned core with single-threaded numpy, because the coordinator is a
small process that must not wait on a plan; both wall-clock and process CPU time are reported,
since on a shared machine the wall clock also counts other processes' turns on the core.

Quality columns: ``vs bound`` divides the predicted bottleneck by a bound no plan can beat: the
pipeline's rate is at most the compute-weighted mean of its stages' rates, so throughput <=
sum over peers of (cost of the block the peer does best per second) / total cost. It is loose
(it lets every peer hold its favourite block at once), so it shows an upper limit on what is
left, not the gap itself. ``vs naive`` divides the bottleneck by that of the obvious replicated
plan (fewest equal blocks that fit, peers dealt round-robin): values below 1 are the planner's
gain. ``--quality N`` also runs the tests' brute-force comparison on N random small swarms.

Run: ``python benchmarks/planner.py`` (``--help`` for options). Prints a table, writes
``benchmarks/out/planner.md`` (the same table in Markdown) and ``benchmarks/out/planner.png``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy loads its thread pools

import argparse  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from coordinator.cost_model import CostModel, InfeasiblePlanError, ModelSpec, PeerSpec  # noqa: E402
from coordinator.planner import evaluate_plan, plan  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent / "out"
GIB, MBIT = 1 << 30, 1e6 / 8

# name, free GiB for the block, speed in layers/s for one 2048-token micro-batch (fwd + bwd), share
GPUS = (
    ("RTX 3060 12G", 10.0, 20.0, 0.25),
    ("RTX 3070 8G", 6.5, 26.0, 0.20),
    ("RTX 3080 10G", 8.5, 36.0, 0.15),
    ("RTX 3090 24G", 22.0, 44.0, 0.15),
    ("RTX 4070 12G", 10.5, 40.0, 0.10),
    ("RTX 4090 24G", 22.0, 80.0, 0.10),
    ("RX 6800 16G", 14.0, 28.0, 0.05),
)


def transformer(n_layers: int, layer_gib: float = 0.9) -> ModelSpec:
    """More GiB per layer means tighter memory, so more and shorter stages."""
    return ModelSpec.uniform(n_layers, layer_memory=layer_gib * GIB, boundary_bytes=4 * (1 << 20))


def swarm(n_peers: int, seed: int = 0) -> list[PeerSpec]:
    rng = random.Random(seed)
    peers = []
    for i in range(n_peers):
        _, mem, speed, _ = rng.choices(GPUS, weights=[g[3] for g in GPUS])[0]
        down = min(max(rng.lognormvariate(math.log(100), 0.8), 5), 1000) * MBIT
        up = min(max(down * rng.uniform(0.1, 0.5), 2 * MBIT), 500 * MBIT)
        peers.append(PeerSpec(f"peer{i}", speed * rng.uniform(0.8, 1.2), mem * GIB * rng.uniform(0.9, 1.0), up, down))
    return peers


def naive_time(peers: list[PeerSpec], model: ModelSpec) -> float:
    """Fewest equal blocks that fit the n-th smallest memory, peers dealt round-robin."""
    L = model.n_layers
    by_mem = sorted(peers, key=lambda p: p.free_memory)
    for k in range(1, min(L, len(peers)) + 1):
        size = math.ceil(L / k)
        fit = [p for p in by_mem if p.free_memory >= size * model.layer_memory[0]]
        if len(fit) >= k:
            bounds = [min(j * size, L) for j in range(k)] + [L]
            bounds = sorted(set(bounds))
            stages = [(a, b, [p.peer_id for p in fit[j :: len(bounds) - 1]]) for j, (a, b) in
                      enumerate(zip(bounds, bounds[1:], strict=False))]
            return evaluate_plan(stages, peers, model).bottleneck_time
    return math.inf


def bottleneck_bound(peers: list[PeerSpec], model: ModelSpec) -> float:
    """Smallest bottleneck any plan could have (see the module docstring)."""
    cm = CostModel(peers, model)
    idx, L = np.arange(cm.n_peers), model.n_layers
    best = np.zeros(cm.n_peers)
    for a in range(L):
        cost = cm.cost_cum[a + 1 :] - cm.cost_cum[a]
        best = np.maximum(best, (cost[None, :] / cm.times_from(idx, a, a + 1, L)).max(axis=1))
    return float(cm.cost_cum[-1] / best.sum())


@dataclass
class Row:
    peers: int
    layers: int
    mode: str
    best_s: float
    median_s: float
    cpu_s: float  # best process CPU time
    stages: int
    throughput: float  # micro-batches/s
    vs_bound: float
    vs_naive: float | None  # replicated rows with a feasible naive plan only (the naive plan replicates)


def measure(n_peers: int, n_layers: int, replicas: bool, repeat: int, layer_gib: float) -> Row | None:
    peers, model = swarm(n_peers, seed=n_peers), transformer(n_layers, layer_gib)
    times, cpu = [], []
    try:
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            result = plan(peers, model, replicas=replicas)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    except InfeasiblePlanError as e:
        print(f"  {n_peers} peers x {n_layers} layers: infeasible ({e})", file=sys.stderr)
        return None
    return Row(
        n_peers, n_layers, "replicas" if replicas else "one per block", min(times), statistics.median(times),
        min(cpu), len(result.stages), result.throughput, result.bottleneck_time / bottleneck_bound(peers, model),
        result.bottleneck_time / naive if replicas and math.isfinite(naive := naive_time(peers, model)) else None,
    )


def quality(cases: int, seed: int) -> list[str]:
    """Gap to the brute-force optimum over random small swarms (the tests' generator and reference)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for tests/
    from tests.test_planner import brute_one_per_block, brute_replicas, planned_or_inf  # noqa: PLC0415

    rng = random.Random(seed)
    lines = []
    for label, replicas, uniform, max_n, max_l in (
        ("one per block, identical layers", False, True, 5, 6),
        ("one per block, mixed layers", False, False, 5, 6),
        ("replicas, identical layers", True, True, 5, 4),
        ("replicas, mixed layers", True, False, 5, 4),
    ):
        gaps = []
        for _ in range(cases):
            L, n = rng.randint(1, max_l), rng.randint(1, max_n)
            if uniform:
                model = ModelSpec.uniform(L, layer_cost=rng.uniform(0.5, 2), layer_memory=100 * rng.randint(1, 3),
                                          boundary_bytes=rng.uniform(0, 3), backward_bytes=rng.uniform(0, 3))
            else:
                model = ModelSpec(tuple(rng.uniform(0.2, 2) for _ in range(L)),
                                  tuple(100 * rng.randint(1, 3) for _ in range(L)),
                                  tuple(rng.uniform(0, 3) for _ in range(L - 1)),
                                  tuple(rng.uniform(0, 3) for _ in range(L - 1)))
            peers = [PeerSpec(f"p{i}", rng.uniform(0.3, 3), 50 * rng.randint(1, 8 * L), rng.uniform(0.5, 10),
                              rng.uniform(0.5, 10)) for i in range(n)]
            best = (brute_replicas if replicas else brute_one_per_block)(peers, model)
            got = planned_or_inf(peers, model, replicas)
            if math.isfinite(best):
                gaps.append(max(got / best - 1, 0.0))  # clamp float noise on exact hits
        exact = sum(g <= 1e-6 for g in gaps)
        lines.append(f"| {label} | {len(gaps)} | {exact / len(gaps):.1%} | {max(gaps):.2%} | "
                     f"{statistics.mean(gaps):.3%} |")
    return ["| case | feasible swarms | optimal | worst gap | mean gap |", "|---|---|---|---|---|", *lines]


def plot(rows: list[Row], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in sorted({r.mode for r in rows}):
        for layers in sorted({r.layers for r in rows}):
            sel = [r for r in rows if r.mode == mode and r.layers == layers]
            if sel:
                ax.plot([r.peers for r in sel], [r.cpu_s for r in sel], marker="o", label=f"{layers} layers, {mode}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="1 s budget")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peers")
    ax.set_ylabel("planning CPU time, best of runs (s)")
    ax.set_title("Ravn partition planner: time to plan (one core)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[10, 30, 100, 300, 1000, 3000, 10000])
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 80])
    ap.add_argument("--solo-max-peers", type=int, default=1000, help="largest swarm for replicas=False rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quality", type=int, default=0, metavar="N", help="compare N small swarms to brute force")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layer-gib", type=float, default=0.9, help="memory per layer held")
    args = ap.parse_args()

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    plan(swarm(20), transformer(8))  # warm up imports and caches outside the timings

    header = ("| peers | layers | mode | wall s (best) | wall s (median) | CPU s (best) | stages | "
              "micro-batches/s | vs bound | vs naive |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    print(header)
    for layers in args.layers:
        for replicas in (True, False):
            for n in args.peers:
                if not replicas and n > args.solo_max_peers:
                    continue
                row = measure(n, layers, replicas, args.repeat, args.layer_gib)
                if row is None:
                    continue
                rows.append(row)
                naive = "-" if row.vs_naive is None else f"{row.vs_naive:.2f}"
                line = (f"| {row.peers} | {row.layers} | {row.mode} | {row.best_s:.3f} | {row.median_s:.3f} | "
                        f"{row.cpu_s:.3f} | {row.stages} | {row.throughput:.3f} | {row.vs_bound:.2f} | {naive} |")
                lines.append(line)
                print(line, flush=True)
    command = "python benchmarks/planner.py " + " ".join(sys.argv[1:])
    env = f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, one pinned core"
    md = [f"Command: `{command.strip()}` ({env})", "", *lines]
    if args.quality:
        table = quality(args.quality, args.seed)
        print(*table, sep="\n")
        md += ["", f"Brute-force comparison, {args.quality} random swarms per case:", "", *table]
    (OUT_DIR / "planner.md").write_text("\n".join(md) + "\n")
    plot(rows, OUT_DIR / "planner.png")
    print(f"wrote {OUT_DIR / 'planner.md'} and {OUT_DIR / 'planner.png'}")


if __name__ == "__main__":
    main()
