"""Kernel bytes per trained token over the course of a run, by thirds: does the wire stay ≥ 16x below fp32?

Why by part of the run: zstd-coded codes compress less as training goes on (docs/codecs.md, "int3_rot"),
so a whole run's bytes per token flatter its end, and issue #19 judges the last third. Why the kernel:
TCP/IP headers, ACKs, gRPC and protobuf framing weigh more on small coded messages than on fp32 ones, and
the shaper of a home link sees them all. One lab run gives every part at once: the lab samples each
peer's interface counters a few times a second, and the bytes of steps ``a``..``b`` are the counters
between the end of step ``a - 1`` and the end of step ``b - 1``, summed over the peers' uplinks (every
byte sent, both directions, all boundaries).

The baseline is Ravn with fp32 wires, whose bytes per token are fixed by the shapes, so a short run
gives them; the mode under test is run for ``--steps`` with the recipe of ``ravn local`` (4 micro-batches
of 4 x 128 per step, seed 0, no validation inside the run), so its losses are those of the convergence
runs on the same machine.

    python -m benchmarks.wire_thirds                          # int3_rot/int3_rot + zstd, 300 steps (~8 min)
    python -m benchmarks.wire_thirds --mode "sync int4_rot/int4_rot zstd" --steps 150

Needs root (network namespaces); run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.lab import Lab, unavailable_reason
from benchmarks.lab_swarm import run_swarm
from benchmarks.pipeline_common import RAVN_MODES, NetSampler, Workload, cap_links

TARGET_RATIO = 16.0


def measure(mode: str, workload: Workload, cap: str, runs_dir: Path, every: int) -> dict:
    """Per window of ``every`` steps: tokens and kernel bytes sent; and the run's own payload count."""
    name = f"{cap}-{mode}".replace(" ", "-").replace("/", "-")
    with Lab(cap_links(cap), coordinator=True) as lab, NetSampler(lab.peers) as sampler:
        result = run_swarm(lab, name, runs_dir, workload.ravn_args(RAVN_MODES[mode]))
        steps = result.steps
        ends = step_ends(steps)
        windows = []
        for lo in range(0, len(steps), every):
            part = steps[lo : lo + every]
            t0 = ends[lo - 1] if lo else ends[0] - steps[0]["seconds"]
            moved = sampler.window(t0, ends[lo + len(part) - 1])
            windows.append(
                {
                    "first_step": part[0]["step"],
                    "last_step": part[-1]["step"],
                    "tokens": sum(s["tokens"] for s in part),
                    "kernel_bytes": sum(b["up"] for b in moved.values()),
                }
            )
    return {
        "mode": mode,
        "cap": cap,
        "windows": windows,
        "losses": [s["loss"] for s in steps],
        "payload_bytes_per_token": result.summary["wire_bytes_per_token"],
    }


def step_ends(steps: list[dict]) -> list[float]:
    """When each step ended, on the lab's clock. The peer measures each step's duration from the end of the
    one before, so the durations tile the run and fix every end up to one offset; its reports travel in
    batches (at most one per ``MIN_REPORT_GAP``, the last one after the final validation), so each arrival
    is at or after its step's end. The report that arrived soonest after its step bounds the offset best.
    (Anchoring at the last report slid every window by the final validation's length.)"""
    ends, t = [], 0.0
    for s in steps:
        t += s["seconds"]
        ends.append(t)
    offset = min(s["time"] - end for s, end in zip(steps, ends, strict=True))
    return [end + offset for end in ends]


def per_token(windows: list[dict]) -> float:
    return sum(w["kernel_bytes"] for w in windows) / max(sum(w["tokens"] for w in windows), 1)


def report(base: dict, run: dict, parts: int) -> str:
    fp32 = per_token(base["windows"][1:] or base["windows"])  # the first window holds connection set-up
    ws = run["windows"]
    lines = [
        f"baseline {base['mode']}: {fp32:,.1f} kernel B/token (payload {base['payload_bytes_per_token']:,.1f})",
        f"{run['mode']} at {run['cap']}: whole run {per_token(ws):,.1f} kernel B/token "
        f"(payload {run['payload_bytes_per_token']:,.1f}), {fp32 / per_token(ws):.1f}x fewer than fp32",
        "",
        "| steps | kernel B/token | fewer than fp32 | target ≥ 16x |",
        "|---|---:|---:|---|",
    ]
    size = -(-len(ws) // parts)
    for i in range(0, len(ws), size):
        chunk = ws[i : i + size]
        b = per_token(chunk)
        ratio = fp32 / b
        lines.append(
            f"| {chunk[0]['first_step']}–{chunk[-1]['last_step'] + 1} | {b:,.1f} | {ratio:.1f}x "
            f"| {'met' if ratio >= TARGET_RATIO else 'missed'} |"
        )
    return "\n".join(lines)


def plot(base: dict, run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp32 = per_token(base["windows"][1:] or base["windows"])
    xs = [(w["first_step"] + w["last_step"] + 1) / 2 for w in run["windows"]]
    ys = [fp32 / (w["kernel_bytes"] / w["tokens"]) for w in run["windows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, marker="o", label=run["mode"])
    ax.axhline(TARGET_RATIO, color="grey", linestyle="--", label="target 16x")
    ax.set_xlabel("step")
    ax.set_ylabel("fewer kernel bytes per token than fp32 (x)")
    ax.set_title(f"Ravn wire bytes over the run ({run['cap']}, kernel counters)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="sync int3_rot/int3_rot zstd", choices=list(RAVN_MODES))
    ap.add_argument("--baseline", default="sync fp32", choices=list(RAVN_MODES))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--baseline-steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=10, help="steps per counter window (the plot's points)")
    ap.add_argument("--parts", type=int, default=3, help="parts of the run in the table")
    ap.add_argument("--cap", default="lan", help="link cap of every peer (bytes do not depend on it)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if reason := unavailable_reason():
        raise SystemExit(f"the swarm lab cannot run here: {reason}")
    args.out.mkdir(parents=True, exist_ok=True)
    workload = dict(micro_batches=4, micro_batch_size=4, eval_every=args.steps + 1, seed=0)  # ravn local's recipe
    with tempfile.TemporaryDirectory(prefix="ravn-thirds-") as tmp:
        base = measure(args.baseline, Workload(steps=args.baseline_steps, **workload), args.cap, Path(tmp), args.every)
        run = measure(args.mode, Workload(steps=args.steps, **workload), args.cap, Path(tmp), args.every)
    text = report(base, run, args.parts)
    print(text)
    stem = args.out / "wire_thirds"
    stem.with_suffix(".json").write_text(json.dumps({"baseline": base, "run": run}, indent=1))
    stem.with_suffix(".md").write_text(text + "\n")
    plot(base, run, stem.with_suffix(".png"))
    print(f"plot: {stem.with_suffix('.png')}")


if __name__ == "__main__":
    main()
