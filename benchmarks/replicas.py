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


def run(name: str, peers: int, args: argparse.Namespace, runs_dir: Path, *extra: str) -> dict:
    cmd = [
        sys.executable, "-m", "coordinator.ravn_cli", "local",
        "--peers", str(peers), "--stages", "3", "--steps", str(args.steps),
        "--micro-batches", str(args.micro_batches), "--micro-batch-size", "4",
        "--eval-every", str(args.steps), "--eval-batches", "8", "--checkpoint-every", "0",
        "--debug-slow-stage", f"1={args.slow}", "--runs-dir", str(runs_dir), "--name", name, *extra,
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
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/replicas"))
    args = parser.parse_args()
    runs = args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)

    rows = [run("solo", 3, args, runs), run("replicated", 4, args, runs, "--replicate", "1", "--average-every", "10")]
    for t in args.every:
        rows.append(run(f"avg-T{t}", 4, args, runs, "--replicate", "1", "--average-every", str(t)))
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))

    solo = rows[0]
    print(f"\nPart 1: middle stage slowed by {args.slow * 1000:.0f} ms per pass, {args.steps} steps")
    print(f"{'swarm':<12}{'peers':>6}{'tok/s':>10}{'speed-up':>10}{'val loss':>10}{'shares':>12}")
    for r in rows[:2]:
        gain = r["tokens_per_s"] / solo["tokens_per_s"]
        print(
            f"{r['name']:<12}{r['peers']:>6}{r['tokens_per_s']:>10,.0f}{gain:>9.2f}x"
            f"{r['val_loss']:>10.4f}{'/'.join(map(str, r['shares'])):>12}"
        )
    print("\nPart 2: averaging every T local steps (int8 changes)")
    print(f"{'T':>5}{'avg B/token':>13}{'wire B/token':>14}{'ratio':>8}{'val loss':>10}{'replica diff':>14}")
    for t, r in zip(args.every, rows[2:], strict=True):
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
        a.bar([r["name"] for r in rows[:2]], [r["tokens_per_s"] for r in rows[:2]], color=["grey", "tab:blue"])
        a.set_ylabel("tokens/s")
        a.set_title("bottleneck block: 1 vs 2 holders")
        ts = [str(t) for t in args.every]
        b.bar(ts, [r["average_bytes_per_token"] for r in rows[2:]], label="averaging")
        b.plot(ts, [r["wire_bytes_per_token"] for r in rows[2:]], "k--", label="activations + gradients")
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
