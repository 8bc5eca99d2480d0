"""Do compression and asynchrony cost loss? Train the built-in GPT through the real pipeline, variant by variant.

Each run is ``ravn local`` exactly as a user runs it (3 peer processes, gRPC on loopback) for the same
number of tokens and the same data; the table compares the final validation loss with the sync fp32 run
and the wire bytes per trained token. With several seeds each row gives the mean, the spread (sample
standard deviation and min..max) and every seed's loss; with ``--error-feedback on off`` each
lossy-backward pair runs with and without error feedback on the gradients (``--error-feedback-backward``).
``--schedules sync async1 async2`` runs every pair on the sync schedule and on the async one with
``--max-staleness`` 1 and 2; an async row is also compared with its pair's sync run seed by seed (same
data, same initial weights), which is less noisy than comparing means. Async runs depend on timing (how
far the pipeline runs ahead), so their losses are not bit-reproducible as sync ones are.

    python -m benchmarks.convergence                      # the codec table, one seed (about 15 min on 2 cores)
    python -m benchmarks.convergence --steps 40 --pairs fp32/fp32 int8/int8
    python -m benchmarks.convergence --model gpt-medium --pairs fp32/fp32 int4_rot/int8 \\
        --error-feedback on off --seeds 0 1 2 --jobs 2   # error feedback on vs off (docs/codecs.md)
    python -m benchmarks.convergence --model gpt-medium --pairs fp32/fp32 int8/int8 \\
        --schedules sync async1 async2 --seeds 0 1 2 --jobs 2   # async against sync (docs/BENCHMARKS.md)

A run whose ``metrics.jsonl`` already holds a summary is read back instead of trained again, so an
interrupted table can be finished (delete ``--out``/convergence-runs to start over).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PAIRS = ["fp32/fp32", "fp16/fp16", "int8/int8", "int4/int8", "int4_rot/int8", "int4/int4", "int4_rot/int4_rot"]
LOSSY = {"int8", "int4", "int4_rot", "int3_rot", "lowrank", "ecsq"}  # swarm.wire.codecs.LOSSY_CODECS, without torch


@dataclass(frozen=True)
class Variant:
    pair: str
    feedback: str  # "auto" / "on" / "off" for a lossy backward codec, "" where error feedback does not apply
    staleness: int = -1  # S of the async schedule; -1: the sync schedule

    @property
    def label(self) -> str:
        label = f"{self.pair} ef={self.feedback}" if self.feedback else self.pair
        return label if self.staleness < 0 else f"{label} async S={self.staleness}"

    @property
    def sync_label(self) -> str:
        """The same codecs on the sync schedule: what an async run is paired with, seed by seed."""
        return Variant(self.pair, self.feedback).label

    def run_name(self, model: str, seed: int) -> str:
        fwd, bwd = self.pair.split("/")
        ef = f"-ef{self.feedback}" if self.feedback else ""
        schedule = f"-async{self.staleness}" if self.staleness >= 0 else ""
        return f"conv-{model}-{fwd}-{bwd}{ef}{schedule}-s{seed}"


def variants(pairs: list[str], feedback: list[str], schedules: list[str]) -> list[Variant]:
    out = []
    for schedule in schedules:
        staleness = -1 if schedule == "sync" else int(schedule.removeprefix("async"))
        for pair in pairs:
            lossy_backward = pair.split("/")[1] in LOSSY
            efs = feedback if lossy_backward else [""]
            out += [Variant(pair, ef, staleness) for ef in efs]
    return out


def run_one(variant: Variant, seed: int, args: argparse.Namespace, runs_dir: Path) -> dict:
    fwd, bwd = variant.pair.split("/")
    name = variant.run_name(args.model, seed)
    metrics_file = runs_dir / name / "metrics.jsonl"
    stdout = ""
    t0 = time.monotonic()
    if not _has_summary(metrics_file):
        cmd = [
            sys.executable, "-m", "coordinator.ravn_cli", "local",
            "--peers", str(args.peers),
            "--steps", str(args.steps),
            "--eval-every", str(args.eval_every),
            "--eval-batches", str(args.eval_batches),
            "--model", args.model,
            "--seed", str(seed),
            "--wire-forward", fwd,
            "--wire-backward", bwd,
            "--runs-dir", str(runs_dir),
            "--name", name,
        ]  # fmt: skip
        if variant.feedback:
            cmd += ["--error-feedback-backward", variant.feedback]
        if variant.staleness >= 0:
            cmd += ["--schedule", "async", "--max-staleness", str(variant.staleness)]
        else:
            cmd += ["--schedule", "sync"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{variant.label} seed {seed} failed:\n{proc.stdout}\n{proc.stderr}")
        stdout = proc.stdout
        (runs_dir / name / "stdout.txt").write_text(stdout)
    elif (runs_dir / name / "stdout.txt").exists():
        stdout = (runs_dir / name / "stdout.txt").read_text()
    metrics = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
    summary = next(m for m in metrics if m["kind"] == "summary")
    evals = [(m["step"], m["loss"]) for m in metrics if m["kind"] == "eval"]
    plan = next((line.removeprefix("plan: ") for line in stdout.splitlines() if line.startswith("plan: ")), "")
    unsplit = unsplit_val_loss(runs_dir / name)
    print(
        f"  {variant.label} seed {seed}: val {summary['final_val_loss']:.4f} through the wire, "
        f"{unsplit:.4f} unsplit fp32 ({plan})",
        flush=True,
    )
    return {
        "variant": variant.label, "sync_variant": variant.sync_label, "pair": variant.pair,
        "feedback": variant.feedback, "staleness_bound": variant.staleness, "seed": seed,
        "wall_s": time.monotonic() - t0, "evals": evals, "plan": plan, "unsplit_val_loss": unsplit, **summary,
    }  # fmt: skip


def unsplit_val_loss(run_dir: Path) -> float:
    """The saved model's validation loss in one process, fp32, no wire: training damage without the codec's
    evaluation noise (the swarm's own validation runs through the activation codec)."""
    import torch

    from swarm.train.checkpoint import load_checkpoint
    from swarm.train.data import Corpus

    train = json.loads((run_dir / "config.json").read_text())["train"]
    model, cfg = load_checkpoint(run_dir / "model.safetensors")
    corpus = Corpus.load(train["data"])
    total = tokens = 0.0
    with torch.no_grad():
        for index in range(train["eval_batches"]):
            x, y = corpus.batch(
                split="val",
                seed=train["data_seed"],
                step=0,
                index=index,
                batch_size=train["micro_batch_size"],
                context=cfg.context,
            )
            total += float(model.loss_sum(model(x), y))
            tokens += y.numel()
    return total / tokens


def _has_summary(metrics_file: Path) -> bool:
    return metrics_file.exists() and any('"kind": "summary"' in x for x in metrics_file.read_text().splitlines())


def table(results: list[dict], labels: list[str]) -> list[str]:
    """One row per variant: mean, spread and per-seed final validation loss at equal tokens."""
    rows = {label: [r for r in results if r["variant"] == label] for label in labels}
    base_label = next((label for label in labels if label == "fp32/fp32"), labels[0])
    base = statistics.fmean(r["final_val_loss"] for r in rows[base_label])
    base_unsplit = statistics.fmean(r["unsplit_val_loss"] for r in rows[base_label])
    lines = [
        f"| variant | seeds | tokens | val loss mean | std | min..max | vs {base_label} | per seed "
        f"| unsplit fp32 mean | vs {base_label} | vs sync, paired by seed | bytes/token | stale at stage 0 "
        "| kept weights peak |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    by_seed = {(r["variant"], r["seed"]): r for r in results}
    for label, rs in rows.items():
        losses = [r["final_val_loss"] for r in rs]
        mean = statistics.fmean(losses)
        std = f"{statistics.stdev(losses):.4f}" if len(losses) > 1 else "–"
        per_seed = ", ".join(f"s{r['seed']} {r['final_val_loss']:.4f}" for r in rs)
        wire = statistics.fmean(r["wire_bytes_per_token"] for r in rs)
        unsplit = statistics.fmean(r["unsplit_val_loss"] for r in rs)
        lines.append(
            f"| {label} | {len(rs)} | {rs[0]['tokens']:,} | {mean:.4f} | {std} | {min(losses):.4f}..{max(losses):.4f} "
            f"| {(mean - base) / base * 100:+.2f}% | {per_seed} | {unsplit:.4f} "
            f"| {(unsplit - base_unsplit) / base_unsplit * 100:+.2f}% | {paired_gap(rs, by_seed)} | {wire:,.0f} "
            f"| {stale_share(rs):.0%} | {kept_peak(rs) / 2**20:.1f} MiB |"
        )
    return lines


def stale_share(rs: list[dict]) -> float:
    """Of the gradients the first stage applied, the share that came back after an update (mean over seeds)."""
    shares = []
    for r in rs:
        counts = r["stages"][0].get("staleness_counts", []) if r.get("stages") else []
        shares.append(sum(counts[1:]) / max(sum(counts), 1))
    return statistics.fmean(shares) if shares else 0.0


def kept_peak(rs: list[dict]) -> int:
    """The most memory any stage held in weights kept for stale backwards (``stash_bytes_peak`` before)."""
    return max(
        (s.get("kept_weights_bytes_peak", s.get("stash_bytes_peak", 0)) for r in rs for s in r.get("stages", [])),
        default=0,
    )


def paired_gap(rs: list[dict], by_seed: dict[tuple[str, int], dict]) -> str:
    """An async row against its codecs' sync run of the same seed (same data, same start): mean and range."""
    gaps = []
    for r in rs:
        sync = by_seed.get((r.get("sync_variant", r["variant"]), r["seed"]))
        if sync is not None and sync is not r:
            gaps.append((r["final_val_loss"] - sync["final_val_loss"]) / sync["final_val_loss"] * 100)
    if not gaps:
        return "–"
    return f"{statistics.fmean(gaps):+.2f}% ({min(gaps):+.1f}..{max(gaps):+.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", nargs="+", default=DEFAULT_PAIRS, help="forward/backward codec pairs")
    ap.add_argument(
        "--error-feedback",
        nargs="+",
        choices=("auto", "on", "off"),
        default=["auto"],
        help="--error-feedback-backward settings to run for each pair with a lossy backward codec (auto: as "
        "`ravn local` decides, on for int3_rot gradients)",
    )
    ap.add_argument(
        "--schedules",
        nargs="+",
        default=["sync"],
        help="'sync' and/or 'asyncS' (the async schedule with --max-staleness S, e.g. async1)",
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="model and data seeds (one run each)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (each one is 3 peers + a coordinator)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs_dir = args.out / "convergence-runs"
    for schedule in args.schedules:
        if schedule != "sync" and not schedule.removeprefix("async").isdigit():
            ap.error(f"--schedules: {schedule!r} is neither 'sync' nor 'asyncS' (e.g. async1)")
    vs = variants(args.pairs, args.error_feedback, args.schedules)
    todo = [(v, seed) for seed in args.seeds for v in vs]  # seed-major: a cut-short table still pairs variants
    print(f"{len(todo)} runs of {args.model}, {args.steps} steps, {args.jobs} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda job: run_one(job[0], job[1], args, runs_dir), todo))
    (args.out / "convergence.json").write_text(json.dumps(results, indent=2))
    print("\n".join(table(results, [v.label for v in vs])))
    plot(results, [v.label for v in vs], args.out / "convergence.png")
    print(f"plot: {args.out / 'convergence.png'}")


def plot(results: list[dict], labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, label in enumerate(labels):
        for j, r in enumerate(x for x in results if x["variant"] == label):
            steps, losses = [s + 1 for s, _ in r["evals"]], [v for _, v in r["evals"]]
            a.plot(steps, losses, "o-", color=f"C{i}", label=label if j == 0 else None, ms=3, alpha=0.8)
    a.set_xlabel("step")
    a.set_ylabel("validation loss")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    b.bar(labels, [statistics.fmean(r["wire_bytes_per_token"] for r in results if r["variant"] == x) for x in labels])
    b.set_ylabel("wire bytes per trained token")
    b.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
