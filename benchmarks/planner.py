"""Benchmark placement (``coordinator/placement.py``): time to place against swarm size, and its quality.

Swarms are drawn from a mix of gaming GPUs (free memory, relative speed) on home links (a few to a few
hundred Mbit/s, upload slower than download), training a stack of identical blocks of a d_model=2048
transformer: 0.9 GiB per layer held, int8 activations and gradients of 2048 tokens (4 MiB) across every
boundary. The chain has ``--stages`` blocks (0: one per peer, at most one per layer); further peers are
replicas. Times are the best of ``--repeat`` runs on one pinned core with single-threaded numpy.

``vs bound`` divides the predicted bottleneck by a bound no placement can beat (every peer computing its
share of the total at full speed, links ignored). ``--quality N`` compares N random small swarms with the
tests' brute force (every order, every split).

Run: ``python benchmarks/planner.py`` (``--help`` for options). Prints a Markdown table and writes it to
``benchmarks/out/planner.md``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy loads its thread pools

import argparse  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from coordinator.cost_model import ModelSpec, PeerSpec  # noqa: E402
from coordinator.placement import PlacementError, place  # noqa: E402

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


def row(n_peers: int, n_layers: int, stages: int, repeat: int) -> str:
    peers, model = swarm(n_peers, seed=n_peers), transformer(n_layers)
    times = []
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            result = place(peers, model, stages=stages)
            times.append(time.perf_counter() - t0)
    except PlacementError as e:
        return f"| {n_peers} | {n_layers} | {stages} | - | - | - | {e} |"
    bound = n_layers / sum(p.speed for p in peers)
    return (
        f"| {n_peers} | {n_layers} | {len(result.blocks)} | {min(times):.3f} | {result.throughput:.3f} | "
        f"{result.bottleneck_time / bound:.2f} | {'even' if result.even else 'weighted'} |"
    )


def quality(cases: int, seed: int) -> list[str]:
    """Gap to the brute-force optimum over random small swarms, with the noise rule off and on."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for tests/
    from coordinator.placement import steady  # noqa: PLC0415
    from tests.test_placement import brute  # noqa: PLC0415

    rng = random.Random(seed)
    gaps: dict[str, list[float]] = {"exact (noise=1, margin=0)": [], "default (noise rule on)": []}
    for _ in range(cases):
        L = rng.randint(1, 6)
        n = rng.randint(1, min(4, L))
        model = ModelSpec.uniform(L, layer_memory=100.0, boundary_bytes=rng.uniform(0, 3))
        peers = [
            PeerSpec(f"p{i}", rng.uniform(0.1, 10), 100.0 * rng.randint(1, 2 * L), rng.uniform(0.5, 10), 5.0)
            for i in range(n)
        ]
        for label, kw, reference in (
            ("exact (noise=1, margin=0)", {"noise": 1.0, "margin": 0.0}, peers),
            ("default (noise rule on)", {}, steady(peers)),
        ):
            best = brute(reference, model)
            if not math.isfinite(best):
                continue
            gaps[label].append(max(place(peers, model, **kw).bottleneck_time / best - 1, 0.0))
    lines = ["| placement | feasible swarms | optimal | worst gap |", "|---|---|---|---|"]
    for label, g in gaps.items():
        lines.append(f"| {label} | {len(g)} | {sum(x <= 1e-9 for x in g) / len(g):.1%} | {max(g):.2%} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[3, 10, 30, 100, 1000])
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 80])
    ap.add_argument("--stages", type=int, default=0, help="chain blocks (0: one per peer, at most one per layer)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quality", type=int, default=0, metavar="N", help="compare N small swarms to brute force")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    lines = [
        "| peers | layers | stages | s (best) | micro-batches/s | vs bound | split |",
        "|---|---|---|---|---|---|---|",
    ]
    for layers in args.layers:
        for n in args.peers:
            lines.append(row(n, layers, min(args.stages, layers), args.repeat))
            print(lines[-1], flush=True)
    if args.quality:
        lines += ["", *quality(args.quality, args.seed)]
        print(*lines[-4:], sep="\n")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    command = f"Command: `python benchmarks/planner.py {' '.join(sys.argv[1:])}`"
    (OUT_DIR / "planner.md").write_text("\n".join([command, "", *lines]) + "\n")
    print(f"wrote {OUT_DIR / 'planner.md'}")


if __name__ == "__main__":
    main()
