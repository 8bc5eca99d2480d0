"""Replicas: do extra peers on the bottleneck block add throughput, and what does averaging cost?

Part 1 (speed): the built-in GPT on 3 peers, with the middle stage made the bottleneck (every holder of
stage 1 sleeps ``--slow`` seconds per forward and per backward: a slow GPU), against the same swarm plus
a 4th peer that the planner adds to stage 1 as a replica. Tokens/s are measured from the steps' own
durations (median over the run after the first steps), so start-up, validation and the final upload
do not count.

Part 2 (averaging): the replicated swarm with T = 1, 10, 100 local steps between averages: averaging
bytes per trained token next to activation/gradient bytes per token, and the validation loss at equal
tokens.

    python -m benchmarks.replicas                 # both parts (about 6 min on 2 cores)
    python -m benchmarks.replicas --seeds 0 1 2   # part 1 repeated with three data/init seeds
    python -m benchmarks.replicas --steps 30 --every 1 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run(name: str, peers: int, args: argparse.Namespace, runs_dir: Path, *extra: str, seed: int = 0) -> dict:
    cmd = [
        sys.executable, "-m", "coordinator.ravn_cli", "local",
        "--peers", str(peers), "--stages", "3", "--steps", str(args.steps),
        "--micro-batches", str(args.micro_batches), "--micro-batch-size", "4",
        "--eval-every", str(args.steps), "--eval-batches", "8", "--checkpoint-every", "0",
        "--debug-slow-stage", f"1={args.slow}", "--runs-dir", str(runs_dir), "--name", name,
        "--seed", str(seed), *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    metrics = [json.loads(x) for x in (runs_dir / name / "metrics.jsonl").read_text().splitlines()]
    summary = next(m for m in metrics if m["kind"] == "summary")
    steps = [m for m in metrics if m["kind"] == "step"]
    warm = steps[min(3, len(steps) - 1) :]
    step_s = statistics.median(m["seconds"] for m in warm)
    tokens_per_step = statistics.median(m["tokens"] for m in warm)
    replicas = [st for st in summary["stages"] if st["stage"] == 1]
    return {
        "name": name,
        "seed": seed,
        "peers": peers,
        "wall_s": time.monotonic() - t0,
        "tokens_per_s": tokens_per_step / step_s,
        "val_loss": summary["final_val_loss"],
        "wire_bytes_per_token": summary["wire_bytes_per_token"],
        "average_bytes_per_token": summary["average_bytes"] / max(summary["tokens"], 1),
        "replica_max_abs_diff": summary["replica_max_abs_diff"],
        "shares": [st["forward_micro_batches"] for st in replicas],
        "tokens": summary["tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--slow", type=float, default=0.03, help="seconds per pass added to stage 1's holders")
    parser.add_argument("--every", type=int, nargs="*", default=[1, 10, 100], help="T values for part 2")
    parser.add_argument("--speed-only", action="store_true", help="part 1 only")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0], help="seeds for part 1 (model init and data)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/replicas"))
    args = parser.parse_args()
    runs = args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)

    pairs = []
    for seed in args.seeds:
        solo = run(f"solo-s{seed}", 3, args, runs, seed=seed)
        rep = run(f"replicated-s{seed}", 4, args, runs, "--replicate", "1", "--average-every", "10", seed=seed)
        pairs.append((solo, rep))
    part2, nesterov = [], None
    if not args.speed_only:
        part2 = [run(f"avg-T{t}", 4, args, runs, "--replicate", "1", "--average-every", str(t)) for t in args.every]
        nesterov = run("avg-T10-nesterov", 4, args, runs, "--replicate", "1", "--average-every", "10",
                       "--outer-lr", "0.7", "--outer-momentum", "0.9")  # fmt: skip
    rows = [r for pair in pairs for r in pair] + part2 + ([nesterov] if nesterov else [])
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))

    print(f"\nPart 1: middle stage slowed by {args.slow * 1000:.0f} ms per pass, {args.steps} steps, T = 10")
    print(
        f"{'seed':>5}{'solo tok/s':>12}{'2 holders':>11}{'speed-up':>10}{'solo val':>10}{'repl val':>10}{'Δ loss':>8}"
    )
    for solo, rep in pairs:
        gain = rep["tokens_per_s"] / solo["tokens_per_s"]
        delta = rep["val_loss"] / solo["val_loss"] - 1
        print(
            f"{solo['seed']:>5}{solo['tokens_per_s']:>12,.0f}{rep['tokens_per_s']:>11,.0f}{gain:>9.2f}x"
            f"{solo['val_loss']:>10.4f}{rep['val_loss']:>10.4f}{delta:>+8.1%}"
        )
    if args.speed_only:
        return
    print("\nPart 2: averaging every T local steps (int8 changes), seed 0")
    print(f"{'T':>5}{'avg B/token':>13}{'wire B/token':>14}{'ratio':>8}{'val loss':>10}{'replica diff':>14}")
    for t, r in [*zip(args.every, part2, strict=True), ("10 N", nesterov)]:
        ratio = r["average_bytes_per_token"] / r["wire_bytes_per_token"]
        print(
            f"{t:>5}{r['average_bytes_per_token']:>13,.0f}{r['wire_bytes_per_token']:>14,.0f}{ratio:>8.2f}"
            f"{r['val_loss']:>10.4f}{r['replica_max_abs_diff']:>14.2e}"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        if pairs:
            a.bar(
                ["solo", "2 holders"],
                [pairs[0][0]["tokens_per_s"], pairs[0][1]["tokens_per_s"]],
                color=["grey", "tab:blue"],
            )
        a.set_ylabel("tokens/s")
        a.set_title("bottleneck block: 1 vs 2 holders")
        ts = [str(t) for t in args.every]
        b.bar(ts, [r["average_bytes_per_token"] for r in part2], label="averaging")
        b.plot(ts, [r["wire_bytes_per_token"] for r in part2], "k--", label="activations + gradients")
        b.set_yscale("log")
        b.set_xlabel("T (local steps between averages)")
        b.set_ylabel("bytes per trained token")
        b.legend()
        fig.tight_layout()
        fig.savefig(args.out / "replicas.png", dpi=120)
        print(f"\nplot: {args.out / 'replicas.png'}")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
