"""Does compression cost loss? Train the built-in GPT through the real pipeline with each codec pair.

Each pair runs ``ravn local`` exactly as a user would (3 peer processes, gRPC on loopback, the sync
schedule) for the same number of tokens and the same data; the table compares the final validation
loss with the fp32 run and the wire bytes per trained token.

    python -m benchmarks.convergence                      # the full table (about 15 min on 2 cores)
    python -m benchmarks.convergence --steps 40 --pairs fp32/fp32 int8/int8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_PAIRS = ["fp32/fp32", "fp16/fp16", "int8/int8", "int4/int8", "int4_rot/int8", "int4/int4", "int4_rot/int4_rot"]


def run_pair(pair: str, args: argparse.Namespace, runs_dir: Path) -> dict:
    fwd, bwd = pair.split("/")
    name = f"conv-{fwd}-{bwd}"
    cmd = [
        sys.executable,
        "-m",
        "coordinator.ravn_cli",
        "local",
        "--peers",
        str(args.peers),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--eval-batches",
        str(args.eval_batches),
        "--model",
        args.model,
        "--wire-forward",
        fwd,
        "--wire-backward",
        bwd,
        "--runs-dir",
        str(runs_dir),
        "--name",
        name,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{pair} failed:\n{proc.stdout}\n{proc.stderr}")
    metrics = [json.loads(x) for x in (runs_dir / name / "metrics.jsonl").read_text().splitlines()]
    summary = next(m for m in metrics if m["kind"] == "summary")
    evals = [(m["step"], m["loss"]) for m in metrics if m["kind"] == "eval"]
    return {"pair": pair, "wall_s": time.monotonic() - t0, "evals": evals, **summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", nargs="+", default=DEFAULT_PAIRS, help="forward/backward codec pairs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs_dir = args.out / "convergence-runs"
    results = []
    for pair in args.pairs:
        print(f"running {pair} ...", flush=True)
        results.append(run_pair(pair, args, runs_dir))
    (args.out / "convergence.json").write_text(json.dumps(results, indent=2))
    base = next((r for r in results if r["pair"] == "fp32/fp32"), results[0])
    header = f"| {'forward/backward':<18} | val loss | vs {base['pair']} | bytes/token | vs fp32 bytes | tok/s |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in results:
        rel = (r["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"] * 100
        ratio = base["wire_bytes_per_token"] / r["wire_bytes_per_token"]
        print(
            f"| {r['pair']:<18} | {r['final_val_loss']:8.4f} | {rel:+8.2f}% | {r['wire_bytes_per_token']:11,.0f} "
            f"| {ratio:12.2f}x | {r['tokens_per_s']:5,.0f} |"
        )
    plot(results, args.out / "convergence.png")
    print(f"plot: {args.out / 'convergence.png'}")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        a.plot([s + 1 for s, _ in r["evals"]], [v for _, v in r["evals"]], "o-", label=r["pair"], ms=3)
    a.set_xlabel("step")
    a.set_ylabel("validation loss")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    b.bar([r["pair"] for r in results], [r["wire_bytes_per_token"] for r in results])
    b.set_ylabel("wire bytes per trained token")
    b.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
