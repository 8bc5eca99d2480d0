"""Ravn against PyTorch's own pipeline parallelism on the same links, model, data and batch.

Baseline: ``torch.distributed.pipelining`` (``ScheduleGPipe`` and ``Schedule1F1B``) over gloo with
fp32 activations, and GPipe with bf16 ones (cast at the stage boundary) as a stronger baseline; one
process per stage, each in its own lab namespace, rendezvous through a TCP store on the coordinator
host (``benchmarks/torch_pipe.py``). Against it: Ravn sync fp32 (the same math, so the same losses)
and Ravn at its best settings (async, compressed wires). Every system trains the same tokens; bytes
are counted by the kernel inside the namespaces for all of them.

Pipeline efficiency = achieved tokens/s / min(compute bound, link bound), where the compute bound
is measured here (each stage's forward + backward alone on one thread, with 3 stage processes
sharing this machine's cores) and the link bound is each peer's cap over the bytes per token its
link actually carried in that run (so it is the bound for that system's own wire format).

    python -m benchmarks.vs_torch_pipelining                          # lan, 50, 10 Mbit/s and a mix (~20 min)
    python -m benchmarks.vs_torch_pipelining --reuse benchmarks/out/pipeline.json   # reuse Ravn runs
    python -m benchmarks.vs_torch_pipelining --quick                  # 4 steps at lan and 10 Mbit/s
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lab import Lab, lab_env, unavailable_reason
from benchmarks.lab.procs import REPO_ROOT, read_line
from benchmarks.pipeline_common import (
    CAPS,
    NetSampler,
    RunRecord,
    Workload,
    busiest_link,
    cap_links,
    compute_bound_tokens_per_s,
    link_bound_tokens_per_s,
    plan_text,
    plot_loss_vs_time,
    run_ravn,
    stage_compute_seconds,
    wait_for_quiet,
)
from swarm.config import MODEL_PRESETS
from swarm.train.model import even_split

STORE_PORT = 29500
N_STAGES = 3
TORCH = {"GPipe fp32": ("gpipe", "fp32"), "1F1B fp32": ("1f1b", "fp32"), "GPipe bf16": ("gpipe", "bf16")}
RAVN = ("sync fp32", "async int4_rot/int8")
BASE = ("torch", "GPipe fp32")
TARGETS = {"10mbit": 5.0, "50mbit": 2.5}  # Ravn-best / torch GPipe tokens/s
TARGET_SYNC_GAP, TARGET_EFFICIENCY = 0.10, 0.8


def run_torch(
    lab: Lab,
    cap: str,
    mode: str,
    workload: Workload,
    work: Path,
    placement: list[int] | None = None,
    timeout_s: float = 1800,
) -> RunRecord:
    """One torch pipelining run: a store in the coordinator's namespace, one worker per peer.

    ``placement[r]`` is the lab peer that runs stage ``r`` (default: stage r on peer r); with
    different links per peer it matters, so the comparison gives torch the placement Ravn planned.
    """
    placement = placement or list(range(N_STAGES))
    hosts = [lab.peers[i] for i in placement]
    schedule, wire = TORCH[mode]
    out = work / f"torch-{cap}-{schedule}-{wire}"
    out.mkdir(parents=True, exist_ok=True)
    # the environment Ravn's peers get (benchmarks/lab_swarm.py), so both allocate memory alike
    env = lab_env({**os.environ, "PYTHONUNBUFFERED": "1", "THP_MEM_ALLOC_ENABLE": "1"})
    co = lab.coordinator
    py = [sys.executable, "-m", "benchmarks.torch_pipe"]
    t_launch = time.time()
    store_log = (out / "store.log").open("w")
    store = co.popen(
        [*py, "store", "--host", co.address, "--port", str(STORE_PORT), "--world", str(N_STAGES)],
        env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=store_log,
    )  # fmt: skip
    if not read_line(store, 60).startswith("READY"):
        raise RuntimeError(f"torch rendezvous store did not start: {(out / 'store.log').read_text()}")
    args = [
        "--world", str(N_STAGES), "--store", f"{co.address}:{STORE_PORT}", "--schedule", schedule, "--wire", wire,
        "--model", workload.model, "--steps", str(workload.steps), "--micro-batches", str(workload.micro_batches),
        "--micro-batch-size", str(workload.micro_batch_size), "--eval-every", str(workload.eval_every),
        "--lr", str(workload.lr), "--grad-clip", str(workload.grad_clip), "--seed", str(workload.seed),
        "--out", str(out),
    ]  # fmt: skip
    with NetSampler(lab.peers) as sampler:
        logs = [(out / f"rank{i}.log").open("w") for i in range(N_STAGES)]
        workers = [
            h.popen(
                [*py, "worker", "--rank", str(i), *args],
                env=env,
                cwd=REPO_ROOT,
                stdout=logs[i],
                stderr=subprocess.STDOUT,
            )
            for i, h in enumerate(hosts)
        ]
        deadline = time.monotonic() + timeout_s
        for w in workers:
            w.wait(timeout=max(1.0, deadline - time.monotonic()))
    if any(w.returncode for w in workers):
        tails = "\n".join((out / f"rank{i}.log").read_text()[-3000:] for i in range(N_STAGES))
        raise RuntimeError(f"torch {mode} at {cap} failed:\n{tails}")
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(N_STAGES)]
    start = ranks[0]["t0"]
    end = max(r["steps"][-1]["time"] for r in ranks)  # a step ends when its last backward is done
    tokens = workload.steps * workload.tokens_per_step
    evals = [(e["time"] - start, (e["step"] + 1) * workload.tokens_per_step, e["loss"]) for e in ranks[-1]["evals"]]
    return RunRecord(
        system="torch",
        mode=mode,
        cap=cap,
        tokens=tokens,
        train_s=end - start,
        final_val_loss=evals[-1][2],
        evals=evals,
        host_bytes=sampler.window(start, end),
        step_ends=[max(r["steps"][i]["time"] for r in ranks) - start for i in range(workload.steps)],
        step_losses=[s["loss"] for s in ranks[-1]["steps"]],
        startup_s=start - t_launch,
        blocks={
            h.name: list(block)
            for h, block in zip(hosts, even_split(MODEL_PRESETS[workload.model].n_layers, N_STAGES), strict=True)
        },
        load=os.getloadavg(),
    )


def _reusable(path: Path | None, workload: Workload) -> list[RunRecord]:
    """Ravn runs of ``benchmarks.pipeline`` with the same workload (they are the same runs)."""
    if path is None or not path.exists():
        return []
    data = json.loads(path.read_text())
    if data["meta"]["workload"] != workload.__dict__:
        print(f"not reusing {path}: it ran another workload", flush=True)
        return []
    return [RunRecord.from_dict(r) for r in data["runs"] if r["system"] == "ravn" and r["mode"] in RAVN]


def _placement(record: RunRecord | None) -> list[int] | None:
    """Peer index per stage of a Ravn run's plan (None if it had no plan on record)."""
    if record is None or len(record.blocks) != N_STAGES:
        return None
    return [int(peer[1:]) for peer, _ in sorted(record.blocks.items(), key=lambda kv: kv[1][0])]


def _all_labels() -> list[str]:
    return [f"Ravn {m}" for m in RAVN] + [f"torch {m}" for m in TORCH]


def run_all(
    caps: list[str], workload: Workload, work: Path, reuse: list[RunRecord], labels: list[str] | None = None
) -> list[RunRecord]:
    """Per cap: Ravn first (its planner places the stages), then torch with the same placement."""
    records = []
    runs = [("ravn", m) for m in RAVN] + [("torch", m) for m in TORCH]
    runs = [(s, m) for s, m in runs if labels is None or f"{'Ravn' if s == 'ravn' else 'torch'} {m}" in labels]
    for cap in caps:
        for system, mode in runs:
            old = next((r for r in reuse if r.cap == cap and r.mode == mode), None)
            if system == "ravn" and old is not None:
                print(f"[{cap}] ravn {mode}: reused from the pipeline benchmark", flush=True)
                records.append(old)
                continue
            print(f"[{cap}] {system} {mode}: {workload.steps} steps ...", flush=True)
            with Lab(cap_links(cap), coordinator=True) as lab:
                if system == "torch":
                    sync = next((r for r in records if r.cap == cap and r.mode == RAVN[0]), None)
                    r = run_torch(lab, cap, mode, workload, work, placement=_placement(sync))
                else:
                    r = run_ravn(lab, cap, mode, workload, work / "ravn")
            print(
                f"[{cap}] {system} {mode}: {r.tokens_per_s:,.0f} tok/s, val loss {r.final_val_loss:.4f}, "
                f"{r.wire_bytes_per_token:,.0f} B/token, blocks {plan_text(r)} (load {r.load[0]:.2f})",
                flush=True,
            )
            records.append(r)
    order = {("torch", m): i for i, m in enumerate(TORCH)} | {("ravn", m): len(TORCH) + i for i, m in enumerate(RAVN)}
    return sorted(records, key=lambda r: (caps.index(r.cap), order[(r.system, r.mode)]))


def _label(r: RunRecord) -> str:
    return f"torch {r.mode}" if r.system == "torch" else f"Ravn {r.mode}"


def efficiencies(r: RunRecord, records: list[RunRecord], compute_bound: float) -> tuple[float, float | None]:
    """Achieved / min(compute bound, link bound), with two compute bounds.

    The first is the stage microbenchmark (the same for every system); the second is the same
    system's own uncapped run in ``records`` (None without one), which isolates how well it turns
    link bandwidth into throughput from how fast it computes.
    """
    link = link_bound_tokens_per_s(r, cap_links(r.cap))
    own = next((u for u in records if u.cap == "lan" and (u.system, u.mode) == (r.system, r.mode)), None)
    return r.tokens_per_s / min(compute_bound, link), (r.tokens_per_s / min(own.tokens_per_s, link) if own else None)


def table(records: list[RunRecord], compute_bound: float) -> str:
    lines = [
        "| cap | system | tokens/s | vs torch GPipe | val loss | wire B/token | busiest link B/token "
        "| link bound tok/s | efficiency (stage bound) | efficiency (own uncapped) | blocks |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        base = next((b for b in records if b.cap == r.cap and (b.system, b.mode) == BASE), None)
        links = cap_links(r.cap)
        link = link_bound_tokens_per_s(r, links)
        eff, eff_own = efficiencies(r, records, compute_bound)
        link_text = "-" if link == float("inf") else f"{link:,.0f}"
        own_text = "-" if eff_own is None or r.cap == "lan" else f"{eff_own:.2f}"
        lines.append(
            f"| {r.cap} | {_label(r)} | {r.tokens_per_s:,.0f} | "
            f"{f'{r.tokens_per_s / base.tokens_per_s:.2f}x' if base else '-'} | {r.final_val_loss:.4f} | "
            f"{r.wire_bytes_per_token:,.0f} | {_busiest_bytes_per_token(r, links)} | {link_text} | {eff:.2f} "
            f"| {own_text} | {plan_text(r)} |"
        )
    return "\n".join(lines)


def _busiest_bytes_per_token(r: RunRecord, links) -> str:
    """Bytes per token on the link direction that bounds the run (the largest one when uncapped)."""
    per_token, where = busiest_link(r, links)
    return "-" if where == "-" else f"{per_token:,.0f} ({where})"


def targets(records: list[RunRecord], compute_bound: float) -> list[tuple[str, bool | None, str]]:
    def get(cap: str, system: str, mode: str) -> RunRecord | None:
        return next((r for r in records if r.cap == cap and r.system == system and r.mode == mode), None)

    out: list[tuple[str, bool | None, str]] = []
    for cap, factor in TARGETS.items():
        best, base = get(cap, "ravn", RAVN[1]), get(cap, *BASE)
        name = f"{cap}: Ravn best >= {factor}x torch GPipe fp32"
        if best and base:
            x = best.tokens_per_s / base.tokens_per_s
            out.append((name, x >= factor, f"{x:.2f}x"))
        else:
            out.append((name, None, "not run"))
    sync, base = get("lan", "ravn", RAVN[0]), get("lan", *BASE)
    if sync and base:
        gap = sync.tokens_per_s / base.tokens_per_s - 1
        out.append(
            (
                "uncapped: Ravn sync fp32 within 10% of torch GPipe",
                abs(gap) <= TARGET_SYNC_GAP or gap > 0,
                f"{gap:+.1%}",
            )
        )
    for which in (0, 1):
        effs = [
            (e, f"{r.cap}/{_label(r)}")
            for r in records
            if (e := efficiencies(r, records, compute_bound)[which]) is not None and (which == 0 or r.cap != "lan")
        ]
        name = "efficiency >= 0.8 at every cap, " + (
            "vs the stage compute bound" if which == 0 else "vs own uncapped run"
        )
        if effs:
            worst = min(effs)
            ravn = min((e for e in effs if "Ravn" in e[1]), default=None)
            ev = f"worst {worst[0]:.2f} ({worst[1]})" + (f"; worst Ravn {ravn[0]:.2f} ({ravn[1]})" if ravn else "")
            out.append((name, worst[0] >= TARGET_EFFICIENCY, ev))
    return out


def plot_bars(records: list[RunRecord], caps: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(_label(r) for r in records))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs, ys = [], []
        for i, cap in enumerate(caps):
            r = next((r for r in records if r.cap == cap and _label(r) == label), None)
            if r is not None:
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                ys.append(r.tokens_per_s)
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(caps)), [c if c != "mix" else "mix\n" + " / ".join(CAPS[c]) for c in caps])
    ax.set_yscale("log")  # 10 Mbit/s fp32 and uncapped differ by more than 10x
    ax.set_ylabel("tokens/s (log scale, higher is better)")
    ax.set_title("gpt-medium, 3 stages, 32 x 128 tokens/step, per-peer link caps", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(labels))
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records: list[RunRecord], meta: dict, out: Path, name: str) -> str:
    """Table, targets and plots of one invocation (or of a saved ``.json``, with ``--from-json``)."""
    bound, stage_s = meta["compute_bound_tokens_per_s"], meta["stage_compute_s"]
    caps = list(meta["caps"])
    lines = [
        f"workload: {meta['workload']}",
        f"compute bound {bound:,.0f} tokens/s (stage fwd+bwd {', '.join(f'{s * 1000:.0f}' for s in stage_s)} ms "
        f"per micro-batch, {meta['cpus']} cores); load at start {meta['load_start']}, at end {meta['load_end']}",
        "",
        table(records, bound),
        "",
        "targets:",
    ]
    for target, ok, ev in targets(records, bound):
        lines.append(f"- {target}: {'met' if ok else 'missed' if ok is not None else 'n/a'} ({ev})")
    text = "\n".join(lines)
    (out / f"{name}.md").write_text(text + "\n")
    plot_bars(records, caps, out / f"{name}-bars.png")
    plot_loss_vs_time(
        records,
        caps,
        out / f"{name}-loss.png",
        "Ravn vs torch.distributed.pipelining (gloo), gpt-medium, 3 stages",
    )
    return text + f"\nplots: {out / f'{name}-bars.png'}, {out / f'{name}-loss.png'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", nargs="+", default=None, choices=sorted(CAPS), help="default: lan 50mbit 10mbit mix")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 16; 4 with --quick)")
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="short runs at lan and 10mbit: a smoke test, not a result")
    ap.add_argument("--systems", nargs="+", default=None, choices=_all_labels(), help="default: all five")
    ap.add_argument("--reuse", type=Path, default=None, help="pipeline.json whose Ravn runs to reuse")
    ap.add_argument("--from-json", type=Path, default=None, help="only redo table and plots of a saved run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--name", default=None, help="stem of the output files (default: the module's name)")
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--max-wait", type=float, default=300)
    args = ap.parse_args()
    name = args.name or ("vs_torch_pipelining-quick" if args.quick else "vs_torch_pipelining")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        print(write_report([RunRecord.from_dict(r) for r in data["runs"]], data["meta"], args.out, name))
        return
    if reason := unavailable_reason():
        sys.exit(f"the swarm lab cannot run here: {reason}")
    caps = args.caps or (["lan", "10mbit"] if args.quick else ["lan", "50mbit", "10mbit", "mix"])
    steps = args.steps or (4 if args.quick else 16)
    workload = Workload(steps=steps, eval_every=args.eval_every or max(1, steps // 4))
    load_start = wait_for_quiet(args.max_load, args.max_wait)
    stage_s = stage_compute_seconds(workload, N_STAGES)
    cores = os.cpu_count() or 1
    bound = compute_bound_tokens_per_s(stage_s, workload.micro_batch_size * workload.context, cores)
    print(f"compute bound: stages {[f'{s * 1000:.0f} ms' for s in stage_s]} per micro-batch, {cores} cores "
          f"-> {bound:,.0f} tokens/s", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ravn-vs-torch-") as tmp:
        records = run_all(caps, workload, Path(tmp), _reusable(args.reuse, workload), args.systems)
    meta = {
        "workload": workload.__dict__,
        "cpus": cores,
        "stage_compute_s": stage_s,
        "compute_bound_tokens_per_s": bound,
        "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "caps": {c: list(CAPS[c]) for c in caps},
    }
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "runs": [r.to_dict() for r in records]}, indent=1))
    print(write_report(records, meta, args.out, name))


if __name__ == "__main__":
    main()
