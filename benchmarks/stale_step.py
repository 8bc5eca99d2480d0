"""What a stale gradient costs one stage: step time with every gradient one version late, against sync.

The async schedule's promise is the sync schedule's compute with the bubbles filled; a stale micro-batch
must therefore cost no more than a fresh one. Before kept weights (swarm/train/kept_weights.py) each one
recomputed its forward: +25% step time on a middle stage of gpt-medium (docs/BENCHMARKS.md). This runs
one ``StageRunner`` alone, with no network, in two loops of K micro-batches per step:

* ``sync``: forward K, backward K, step (GPipe: nothing in flight at the update);
* ``stale``: forward the next K, then backward the previous K and step, so every backward meets weights
  one version newer than its forward saw (S = 1, 100% stale: the worst case of the async schedule).

It prints the median step time of each (after warm-up), their ratio, the forwards run (no recompute means
one per micro-batch) and the peak bytes of kept weights. Run it alone on a quiet machine:

    PYTHONPATH=. python -m benchmarks.stale_step                # gpt-medium middle stage, 8 x (4 x 128)
    PYTHONPATH=. python -m benchmarks.stale_step --steps 12 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.train.stage_runner import StageRunner


def build(model: str, layers: tuple[int, int], k: int, batch: int, staleness: int) -> StageRunner:
    cfg = MODEL_PRESETS[model]
    schedule = "async" if staleness else "sync"
    train = TrainConfig(micro_batches=k, micro_batch_size=batch, schedule=schedule, max_staleness=staleness)
    return StageRunner(cfg, train, *layers)


def run(mode: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    r = build(args.model, (args.start, args.end), args.micro_batches, args.batch, 1 if mode == "stale" else 0)
    cfg, k = r.model_cfg, args.micro_batches
    forwards = []
    r.model.register_forward_hook(lambda *_: forwards.append(1))
    x = torch.randn(args.batch, cfg.context, cfg.d_model)
    g = torch.randn(args.batch, cfg.context, cfg.d_model) * 1e-3
    times, mb = [], 0
    if mode == "stale":
        for _ in range(k):  # the first step's micro-batches, in flight before the loop
            r.forward(mb, x)
            mb += 1
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        first = mb - k if mode == "stale" else mb
        for _ in range(k):
            r.forward(mb, x)
            mb += 1
        for i in range(first, first + k):
            r.backward(i, g)
        times.append(time.perf_counter() - t0)
    stale = r.metrics.staleness_counts()
    return {
        "mode": mode,
        "step_ms": statistics.median(times[args.warmup :]) * 1e3,
        "forwards_per_micro_batch": len(forwards) / mb,
        "stale_share": (sum(stale[1:]) / sum(stale)) if sum(stale) else 0.0,
        "kept_bytes_peak": r.metrics.kept_weights_bytes_peak,
        "trainable_bytes": sum(p.numel() * p.element_size() for p in r.trainable),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-medium", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--start", type=int, default=2, help="first layer of the stage (a middle stage by default)")
    ap.add_argument("--end", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: one core, as on a busy peer)")
    ap.add_argument("--rounds", type=int, default=3, help="sync and stale alternate this many times")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = [run(mode, args) for _ in range(args.rounds) for mode in ("sync", "stale")]
    print(
        f"{args.model} layers [{args.start},{args.end}), {args.micro_batches} micro-batches of "
        f"{args.batch} x {MODEL_PRESETS[args.model].context}, {args.threads} thread(s), "
        f"median of {args.steps} steps, {args.rounds} alternating rounds"
    )
    print("| mode | step ms (per round) | median | forwards / micro-batch | stale | kept weights peak |")
    print("|---|---|---:|---:|---:|---:|")
    medians = {}
    for mode in ("sync", "stale"):
        rs = [r for r in results if r["mode"] == mode]
        medians[mode] = statistics.median(r["step_ms"] for r in rs)
        kept = rs[-1]["kept_bytes_peak"]
        per_round = " / ".join(f"{r['step_ms']:.0f}" for r in rs)
        print(
            f"| {mode} | {per_round} | {medians[mode]:.0f} "
            f"| {rs[-1]['forwards_per_micro_batch']:.2f} | {rs[-1]['stale_share']:.0%} "
            f"| {kept / 2**20:.2f} MiB ({kept / rs[-1]['trainable_bytes']:.1f}x trainable) |"
        )
    print(f"stale / sync step time: {medians['stale'] / medians['sync']:.3f}")


if __name__ == "__main__":
    main()
