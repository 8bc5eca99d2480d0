"""Time to a target validation loss on home links: torch GPipe (fp32, bf16) against Ravn's defaults.

Bytes are not time (a 6.4x byte cut bought 1.62x in time to the target loss in AQ-SGD's tables), so
this benchmark judges a wire by how soon it reaches a loss. Two measurements, each where it is exact:

* **Steps to the target** come from ``benchmarks.convergence`` runs (3 seeds x 300 steps of
  gpt-medium, sync schedule, validation every 10 steps): per seed, the target is the fp32 run's
  validation loss at 80% of its steps, and each system needs the first (interpolated) step at which
  its validation loss of the same seed reaches it. On the sync schedule the losses do not depend on
  the link, so these runs may be made on loopback. torch GPipe computes Ravn's sync math (same model,
  data, recipe; ``benchmarks/torch_pipe.py``): its fp32 curve is Ravn's sync fp32 curve and its bf16
  curve Ravn's sync bf16/bf16 one (the same cast at the boundary). The lab runs below check that
  claim: their training losses are compared step by step with the loss runs of seed 0.
* **Seconds per step** come from the swarm lab at each link cap (3 peer namespaces behind shapers,
  kernel byte counters): the median step time after ``--skip`` warm-up steps, no validation inside.

Time to target = steps to target x seconds per step. Next to it: the link-bound time, steps x the
busiest link direction's bytes per step / its rate, which is what a peer whose compute is fast and
overlapped (a GPU) would see. Where the measured step is more than 25% over that, the run is bound by
this 2-core machine's compute (or, for GPipe, which does not overlap sending with computing, by the
two in series), and the table says "compute".

    python -m benchmarks.convergence --model gpt-medium --steps 300 --eval-every 10 --seeds 0 1 2 \\
        --pairs fp32/fp32 bf16/bf16 int3_rot/ecsq int3_rot/int3_rot --jobs 2 --out benchmarks/out/ttt
    python -m benchmarks.time_to_target --convergence benchmarks/out/ttt   # the lab part (~15 min)
    python -m benchmarks.time_to_target --convergence benchmarks/out/ttt --from-json benchmarks/out/time_to_target.json

Needs root (network namespaces); run it alone (docs/lab.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.convergence import LOSSY, Variant
from benchmarks.lab import Lab, unavailable_reason
from benchmarks.pipeline_common import (
    CAPS,
    RunRecord,
    Workload,
    busiest_link,
    cap_links,
    link_bound_tokens_per_s,
    run_ravn,
    wait_for_quiet,
)
from benchmarks.vs_torch_pipelining import run_torch

TARGET_FRACTION = 0.8  # the target is the fp32 run's validation loss at this share of its steps
COMPUTE_BOUND_MARGIN = 1.25  # measured / link-bound step time above this: the CPU, not the link, decides


@dataclass(frozen=True)
class System:
    label: str
    system: str  # "torch" or "ravn"
    mode: str  # the mode name in vs_torch_pipelining.TORCH or pipeline_common.RAVN_MODES
    pair: str  # the convergence pair whose loss curve this system computes


SYSTEMS = (
    System("torch GPipe fp32", "torch", "GPipe fp32", "fp32/fp32"),
    System("torch GPipe bf16", "torch", "GPipe bf16", "bf16/bf16"),
    # the coding (zstd, ecsq's by rows) is lossless: the same loss curve as the plain pair, fewer bytes on the wire
    System("Ravn int3_rot/ecsq, coded (default)", "ravn", "sync int3_rot/ecsq zstd", "int3_rot/ecsq"),
    System(
        "Ravn int3_rot/int3_rot + zstd (default until 2026-12-05)",
        "ravn",
        "sync int3_rot/int3_rot zstd",
        "int3_rot/int3_rot",
    ),
    System(
        "Ravn int4_rot/int4_rot + zstd (default until 2026-12-03)",
        "ravn",
        "sync int4_rot/int4_rot zstd",
        "int4_rot/int4_rot",
    ),
    System("Ravn int4_rot/int4_rot (default until zstd)", "ravn", "sync int4_rot/int4_rot", "int4_rot/int4_rot"),
    System("Ravn int4_rot/int8 (default until 2026-12-02)", "ravn", "sync int4_rot/int8", "int4_rot/int8"),
    System("Ravn lowrank/int3_rot + zstd (opt-in)", "ravn", "sync lowrank/int3_rot zstd", "lowrank/int3_rot"),
    System("Ravn lowrank/ecsq, coded (opt-in)", "ravn", "sync lowrank/ecsq zstd", "lowrank/ecsq"),
    System("Ravn int8/int8 (default on 2026-12-01)", "ravn", "sync int8/int8", "int8/int8"),
)
BASELINES = ("torch GPipe fp32", "torch GPipe bf16")


# ---- steps to the target, from the loss runs ----------------------------------------------------


def crossing_step(evals: list[tuple[int, float]], target: float) -> float | None:
    """Steps trained when the validation loss first reaches ``target``, linearly between evaluations.

    ``evals`` are (step index, loss); an evaluation after step index ``s`` has seen ``s + 1`` steps.
    None if the run never reaches it.
    """
    prev: tuple[int, float] | None = None
    for step, loss in evals:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step + 1)
            (s0, l0), s1 = prev, step
            return (s0 + 1) + (l0 - target) / (l0 - loss) * (s1 - s0)
        prev = (step, loss)
    return None


def steps_to_target(results: list[dict]) -> dict[str, dict]:
    """Per convergence pair: the per-seed targets, the steps each seed took, and the run length."""
    by = {(r["pair"], r["seed"]): r for r in results if r["staleness_bound"] < 0 and not r["feedback"] == "on"}
    seeds = sorted(s for p, s in by if p == "fp32/fp32")
    if not seeds:
        raise SystemExit("the convergence runs have no sync fp32/fp32 run to take the target from")
    out: dict[str, dict] = {}
    for pair in sorted({p for p, _ in by}):
        per_seed = {}
        for seed in seeds:
            base, run = by[("fp32/fp32", seed)], by.get((pair, seed))
            if run is None:
                continue
            at = round(TARGET_FRACTION * base["steps"]) - 1
            target = dict(base["evals"]).get(at)
            if target is None:
                raise SystemExit(
                    f"fp32 seed {seed} has no validation after step index {at}: rerun the convergence "
                    f"benchmark with an --eval-every that divides {at + 1}"
                )
            per_seed[seed] = {"target": target, "steps": crossing_step(run["evals"], target)}
        feedback = next(r["feedback"] for (p, _), r in by.items() if p == pair)
        out[pair] = {"per_seed": per_seed, "run_steps": by[("fp32/fp32", seeds[0])]["steps"], "feedback": feedback}
    return out


def load_convergence(path: Path) -> tuple[list[dict], Path]:
    """Results of ``benchmarks.convergence`` and the folder of its runs."""
    path = path / "convergence.json" if path.is_dir() else path
    return json.loads(path.read_text()), path.parent / "convergence-runs"


def train_losses(runs_dir: Path, pair: str, seed: int, model: str, feedback: str | None = None) -> list[float]:
    """Per-step training losses of one sync convergence run, from its ``metrics.jsonl``; ``feedback``: its
    ``--error-feedback-backward`` (None: ``off`` where the backward codec is lossy, as before ``auto``)."""
    if feedback is None:
        feedback = "off" if pair.split("/")[1] in LOSSY else ""
    metrics = runs_dir / Variant(pair, feedback).run_name(model, seed) / "metrics.jsonl"
    if not metrics.exists():
        return []
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return [m["loss"] for m in rows if m["kind"] == "step" and m["loss"] is not None]


# ---- seconds per step, from the lab -------------------------------------------------------------


def seconds_per_step(r: RunRecord, skip: int) -> float:
    """Median wall time of one step after the first ``skip`` steps (start-up, warm-up)."""
    ends = r.step_ends
    return statistics.median(b - a for a, b in zip(ends[skip:], ends[skip + 1 :], strict=False))


def link_seconds_per_step(r: RunRecord, workload: Workload) -> float:
    """Seconds one step needs on the busiest link direction alone: what a GPU peer would see."""
    bound = link_bound_tokens_per_s(r, cap_links(r.cap))
    return workload.tokens_per_step / bound if bound != float("inf") else 0.0


def run_lab(caps: list[str], workload: Workload, work: Path, systems: list[System]) -> list[RunRecord]:
    """Each (cap, system) in a fresh lab; torch on the even split, Ravn where its planner puts it."""
    records = []
    for cap in caps:
        for sys_ in systems:
            print(f"[{cap}] {sys_.label}: {workload.steps} steps ...", flush=True)
            with Lab(cap_links(cap), coordinator=True) as lab:
                if sys_.system == "torch":
                    r = run_torch(lab, cap, sys_.mode, workload, work)
                else:
                    r = run_ravn(lab, cap, sys_.mode, workload, work / "ravn")
            print(f"[{cap}] {sys_.label}: {r.tokens_per_s:,.0f} tok/s (load {r.load[0]:.2f})", flush=True)
            records.append(r)
    return records


# ---- the report ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    label: str
    bytes_per_token: float  # on the link direction that bounds the run
    step_s: float  # measured
    link_step_s: float  # the busiest link alone
    steps_text: str
    steps: float  # mean steps to target over seeds
    lower_bound: bool  # some seed did not reach it: ``steps`` counts it at the run's length

    @property
    def bound(self) -> str:
        return "compute" if self.link_step_s and self.step_s > COMPUTE_BOUND_MARGIN * self.link_step_s else "link"


def _steps_text(per_seed: dict, run_steps: int) -> tuple[str, float, bool]:
    """Mean steps to target over seeds; a seed that never got there counts as the run's length.

    Returns (text, mean, lower_bound): with any such seed the mean is only a lower bound.
    """
    steps = [v["steps"] for v in per_seed.values()]
    reached = [s for s in steps if s is not None]
    counted = [s if s is not None else float(run_steps) for s in steps]
    mean = statistics.fmean(counted)
    if not reached:
        return f"not reached in {run_steps} ({len(steps)} seeds)", mean, True
    text = f"{statistics.fmean(reached):.0f} ({min(reached):.0f}..{max(reached):.0f})"
    if len(reached) < len(steps):
        text = f"≥ {mean:.0f}: {len(steps) - len(reached)} of {len(steps)} seeds not in {run_steps} steps"
        return text, mean, True
    return text, mean, False


def cap_rows(records: list[RunRecord], targets: dict[str, dict], cap: str, workload: Workload, skip: int) -> list[Row]:
    rows = []
    for sys_ in SYSTEMS:
        r = next((r for r in records if r.cap == cap and r.mode == sys_.mode), None)
        if r is None or sys_.pair not in targets:
            continue
        text, mean, lower = _steps_text(targets[sys_.pair]["per_seed"], targets[sys_.pair]["run_steps"])
        rows.append(
            Row(
                sys_.label,
                busiest_link(r, cap_links(r.cap))[0],
                seconds_per_step(r, skip),
                link_seconds_per_step(r, workload),
                text,
                mean,
                lower,
            )
        )
    return rows


def _speedups(row: Row, rows: list[Row], seconds: str) -> list[str]:
    """Time to target and the speed-up over each baseline, on measured or on link-bound step times.

    Where a run's steps are a lower bound (a seed never reached the target), so is its time, and a
    speed-up over it becomes an upper bound: marked ``≥`` and ``≤``.
    """
    mine = row.steps * getattr(row, seconds)
    cells = [f"{'≥ ' if row.lower_bound else ''}{mine / 60:.1f} min"]
    for name in BASELINES:
        base = next((b for b in rows if b.label == name), None)
        if base is None or mine <= 0 or (base.lower_bound and row.lower_bound):
            cells.append("–")
            continue
        mark = "≤ " if row.lower_bound else "≥ " if base.lower_bound else ""
        cells.append(f"{mark}{base.steps * getattr(base, seconds) / mine:.2f}x")
    return cells


def report(records: list[RunRecord], targets: dict[str, dict], meta: dict, runs_dir: Path | None) -> str:
    workload = Workload(**meta["workload"])
    fp32 = targets["fp32/fp32"]
    lines = [
        f"workload: {meta['workload']}; step time = median after {meta['skip']} steps; "
        f"load at start {meta['load_start']}, at end {meta['load_end']}",
        f"target per seed: sync fp32's validation loss after {TARGET_FRACTION:.0%} of its {fp32['run_steps']} "
        "steps: " + ", ".join(f"s{s} {v['target']:.4f}" for s, v in fp32["per_seed"].items()),
        "",
    ]
    for cap in meta["caps"]:
        lines += [
            f"### {cap} ({', '.join(dict.fromkeys(CAPS[cap]))} per peer)",
            "",
            "| system | busiest link B/token | s/step measured | s/step link alone | bound here "
            "| steps to target, mean (min..max) | time to target | vs GPipe fp32 | vs GPipe bf16 "
            "| link-bound time to target | vs GPipe fp32 | vs GPipe bf16 |",
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = cap_rows(records, targets, cap, workload, meta["skip"])
        for row in rows:
            cells = [
                row.label, f"{row.bytes_per_token:,.0f}", f"{row.step_s:.2f}", f"{row.link_step_s:.2f}", row.bound,
                row.steps_text, *_speedups(row, rows, "step_s"), *_speedups(row, rows, "link_step_s"),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Training losses of the lab runs (seed 0) against the loss runs' first steps:", ""]
    for r in records:
        sys_ = next(s for s in SYSTEMS if s.mode == r.mode)
        feedback = targets.get(sys_.pair, {}).get("feedback")
        ref = train_losses(runs_dir, sys_.pair, 0, workload.model, feedback) if runs_dir else []
        n = min(len(ref), len(r.step_losses))
        if n:
            pairs = list(zip(ref[:n], r.step_losses[:n], strict=True))
            diff = max(abs(a - b) for a, b in pairs)
            first = next((i for i, (a, b) in enumerate(pairs) if abs(a - b) > 1e-4), None)
            where = "" if first is None else f", first above 1e-4 at step {first}"
            head = f"- {r.cap}, {sys_.label} vs Ravn sync {sys_.pair}"
            lines.append(f"{head}: max |difference| {diff:.2e}{where} ({n} steps)")
    return "\n".join(lines)


def plot(records: list[RunRecord], results: list[dict], targets: dict[str, dict], meta: dict, path: Path) -> None:
    """Validation loss (mean over seeds) against minutes of training at each cap's measured step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = meta["caps"]
    fig, axes = plt.subplots(1, len(caps), figsize=(5.2 * len(caps), 4.2), squeeze=False)
    target = statistics.fmean(v["target"] for v in targets["fp32/fp32"]["per_seed"].values())
    for ax, cap in zip(axes[0], caps, strict=True):
        for sys_ in SYSTEMS:
            r = next((r for r in records if r.cap == cap and r.mode == sys_.mode), None)
            runs = [x for x in results if x["pair"] == sys_.pair and x["staleness_bound"] < 0 and x["feedback"] != "on"]
            if r is None or not runs:
                continue
            step_s = seconds_per_step(r, meta["skip"])
            curves = [dict(x["evals"]) for x in runs]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            mean = [statistics.fmean(c[s] for c in curves) for s in steps]
            ax.plot([(s + 1) * step_s / 60 for s in steps], mean, "s--" if sys_.system == "torch" else "o-",
                    ms=2, label=sys_.label)  # fmt: skip
        ax.axhline(target, color="grey", lw=0.8, ls=":", label="target (mean of seeds)")
        ax.set_title(f"{cap}: {', '.join(dict.fromkeys(CAPS[cap]))} per peer", fontsize=10)
        ax.set_xlabel("minutes of training (steps x measured s/step)")
        ax.set_ylim(target - 0.25, target + 0.6)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss, mean of seeds")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("gpt-medium, 3 stages, 4 x 4 x 128 tokens/step: time to the target loss", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convergence", type=Path, required=True, help="out folder (or .json) of the loss runs")
    ap.add_argument("--caps", nargs="+", default=["10mbit", "50mbit"], choices=sorted(CAPS))
    ap.add_argument("--steps", type=int, default=24, help="steps per lab run")
    ap.add_argument("--skip", type=int, default=4, help="steps before the timed ones")
    ap.add_argument("--micro-batches", type=int, default=4, help="as in the loss runs (ravn local's default)")
    ap.add_argument("--from-json", type=Path, default=None, help="only redo the report of a saved lab run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--max-wait", type=float, default=300)
    ap.add_argument(
        "--pairs",
        nargs="+",
        default=None,
        help="time only the systems computing these loss pairs, e.g. int3_rot/ecsq (default: every pair with loss "
        "runs); to time one wire against another build without timing the baselines again",
    )
    args = ap.parse_args()
    results, runs_dir = load_convergence(args.convergence)
    targets = steps_to_target(results)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        records, meta = [RunRecord.from_dict(r) for r in data["runs"]], data["meta"]
    else:
        if reason := unavailable_reason():
            sys.exit(f"the swarm lab cannot run here: {reason}")
        workload = Workload(steps=args.steps, micro_batches=args.micro_batches, eval_every=args.steps)
        load_start = wait_for_quiet(args.max_load, args.max_wait)
        with tempfile.TemporaryDirectory(prefix="ravn-ttt-") as tmp:
            # a system whose pair has no loss runs has no time to the target: it is not timed either
            systems = [s for s in SYSTEMS if s.pair in targets and (args.pairs is None or s.pair in args.pairs)]
            records = run_lab(args.caps, workload, Path(tmp), systems)
        meta = {
            "workload": workload.__dict__,
            "skip": args.skip,
            "caps": args.caps,
            "load_start": [round(x, 2) for x in load_start],
            "load_end": [round(x, 2) for x in os.getloadavg()],
        }
        path = args.out / "time_to_target.json"
        path.write_text(json.dumps({"meta": meta, "targets": targets, "runs": [r.to_dict() for r in records]}))
    text = report(records, targets, meta, runs_dir)
    (args.out / "time_to_target.md").write_text(text + "\n")
    plot(records, results, targets, meta, args.out / "time_to_target.png")
    print(text + f"\nplot: {args.out / 'time_to_target.png'}")


if __name__ == "__main__":
    main()
