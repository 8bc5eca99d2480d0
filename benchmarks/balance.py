"""Does the planner split identical peers evenly, and does the compute follow?

Runs the default ``ravn local --peers 3`` a few times on this one machine (three identical peers) and prints
each run's plan and every stage's ``compute_seconds`` from the run summary, as a deviation from the mean of
the stages. With ``--kill``, a 4-peer run loses its stage-1 peer to SIGKILL after ``--kill-at`` steps and the
table shows the survivors' re-plan as well.

    python -m benchmarks.balance                     # 3 runs of the default local swarm (~1.5 min each)
    python -m benchmarks.balance --runs 1 --kill     # the re-plan after a SIGKILL
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAN = re.compile(r"^plan: (.*)$", re.M)
REPLAN = re.compile(r"recovered without [^:]*: plan (.*?); resuming", re.M)


def peer_pid(root: int, name: str) -> int | None:
    """The ``ravn-peer join`` process named ``name`` among the descendants of ``root``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if b"join" in argv and name.encode() in argv:
            pid, ppid = int(entry.name), int(stat[1])
            while ppid > 1:
                if ppid == root:
                    return pid
                try:
                    ppid = int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except OSError:
                    break
    return None


def one_run(runs_dir: Path, name: str, kill_at: int | None, steps: int | None) -> dict:
    peers = 4 if kill_at is not None else 3
    cmd = [sys.executable, "-m", "coordinator.ravn_cli", "local", "--peers", str(peers), "--runs-dir", str(runs_dir)]
    cmd += ["--name", name] + (["--steps", str(steps)] if steps else [])
    if kill_at is not None:
        cmd += ["--checkpoint-every", "5", "--heartbeat", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    killed = ""
    t0 = time.monotonic()
    for line in proc.stdout:
        out.append(line)
        m = re.match(r"^step (\d+)/", line)
        if kill_at is not None and not killed and m and int(m.group(1)) >= kill_at:
            first = PLAN.search("".join(out)).group(1)
            killed = [p.split("=")[0] for p in first.split(", ")][1]
            pid = peer_pid(proc.pid, killed)
            if pid is None:
                raise RuntimeError(f"no process for {killed}")
            os.kill(pid, signal.SIGKILL)
    if proc.wait() != 0:
        raise RuntimeError("".join(out[-30:]))
    text = "".join(out)
    metrics = [json.loads(x) for x in (runs_dir / name / "metrics.jsonl").read_text().splitlines()]
    summary = next(m for m in metrics if m["kind"] == "summary")
    speeds = [
        float(m.group(1))
        for log in sorted((runs_dir / name / "logs").glob("*.log"))
        for m in re.finditer(r"announced in swarm .*?\(([\d.]+) layers/s", log.read_text())
    ]
    return {
        "announced_layers_per_s": speeds,
        "plans": PLAN.findall(text) + REPLAN.findall(text),
        "killed": killed,
        "seconds": time.monotonic() - t0,
        "compute_seconds": [st["compute_seconds"] for st in summary["stages"]],
        "tokens_per_s": summary["tokens_per_s"],
        "final_val_loss": summary["final_val_loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kill", action="store_true", help="4 peers; SIGKILL the stage-1 peer mid-run")
    ap.add_argument("--kill-at", type=int, default=40)
    ap.add_argument("--steps", type=int, default=None, help="default: ravn local's")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/balance.json"))
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; load {os.getloadavg()[0]:.2f}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            r = one_run(Path(tmp), f"balance-{i}", args.kill_at if args.kill else None, args.steps)
            results.append(r)
            mean = statistics.fmean(r["compute_seconds"])
            devs = ", ".join(f"{c:.1f} s ({(c - mean) / mean:+.0%})" for c in r["compute_seconds"])
            print(f"run {i}: {r['seconds']:.0f} s, {r['tokens_per_s']:,.0f} tok/s, val {r['final_val_loss']:.3f}")
            print("  announced layers/s: " + ", ".join(f"{v:.1f}" for v in r["announced_layers_per_s"]))
            for j, plan in enumerate(r["plans"]):
                print(f"  plan {j}: {plan}" + (f"   (after SIGKILL of {r['killed']})" if j else ""))
            print(f"  compute per stage: {devs}; worst {max(abs(c - mean) / mean for c in r['compute_seconds']):.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"commit": commit, "runs": results}, indent=1))
    print(f"load {os.getloadavg()[0]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
