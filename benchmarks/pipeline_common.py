"""What the pipeline benchmarks share: the workload, the link caps, traffic counters, run records.

``pipeline.py`` (Ravn's schedules and codecs) and ``vs_torch_pipelining.py`` (Ravn against PyTorch's
own pipelining) must measure the same thing the same way, or their tables cannot be read side by
side: one workload, one definition of the training window (first step's start to last step's end,
validation passes in between included, start-up and the final validation excluded), and one byte
counter (the kernel's per-interface counters inside each peer's namespace, so TCP/IP headers and
ACKs count for every system exactly as the shaper sees them).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.lab import Lab, LinkProfile, parse_link
from benchmarks.lab.lab import Host
from benchmarks.lab_swarm import run_swarm
from swarm.config import DEFAULT_GRAD_CLIP, DEFAULT_LR, MODEL_PRESETS

# Per-peer links of each cap, in stage order (p0 holds the embeddings, p2 the head and the loss).
# "mix": a cable uploader feeds a fiber peer whose output goes to an LTE peer, so the narrowest
# pipe is the last stage's 10 Mbit/s upload carrying gradients back. (A DSL peer's 1 Mbit/s upload
# would make one fp32 run take ~10 minutes.)
CAPS: dict[str, tuple[str, ...]] = {
    "lan": ("lan",) * 3,
    "50mbit": ("50mbit",) * 3,
    "10mbit": ("10mbit",) * 3,
    # Where the link, not these 2 CPU cores, sets the pace at the int3_rot default (~65 bytes per token
    # each way on the middle peer's link: 1,466-1,611 tokens/s measured at 1 Mbit/s, about half of what the cores do),
    # as 10 and 50 Mbit/s are for a GPU peer: what async buys when the wire is the bottleneck.
    "1mbit": ("1mbit",) * 3,
    "mix": ("cable:200/20", "fiber", "lte:50/10"),
}

RAVN_SYNC = ("--schedule", "sync")
# speed runs time async from the end of the warm-up (``timed_from``): no sync steps beyond it, as before they existed;
# the full window ((S + 1) x K in flight), as before the cap at K became async's default ("in-flight 4" modes cap)
RAVN_ASYNC = ("--schedule", "async", "--max-staleness", "1", "--sync-steps", "0", "--max-in-flight", "0")
RAVN_FP32 = ("--wire-forward", "fp32", "--wire-backward", "fp32")
RAVN_PLAIN = ("--wire-zstd", "off")  # 4-bit codes as the codec makes them, as every row before zstd coding
RAVN_CODECS = ("--wire-forward", "int4_rot", "--wire-backward", "int8", *RAVN_PLAIN)  # the defaults until 2026-12-02
RAVN_INT8 = ("--wire-forward", "int8", "--wire-backward", "int8")  # the defaults on 2026-12-01
RAVN_BF16 = ("--wire-forward", "bf16", "--wire-backward", "bf16")
RAVN_INT4 = ("--wire-forward", "int4_rot", "--wire-backward", "int4_rot", *RAVN_PLAIN)  # docs/codecs.md
RAVN_INT4_ZSTD = ("--wire-forward", "int4_rot", "--wire-backward", "int4_rot", "--wire-zstd", "on")  # the defaults
RAVN_INT3_ZSTD = ("--wire-forward", "int3_rot", "--wire-backward", "int3_rot", "--wire-zstd", "on")  # docs/codecs.md
RAVN_ECSQ = ("--wire-forward", "int3_rot", "--wire-backward", "ecsq", "--wire-zstd", "on")  # default until 12-06
# rank-32 factors for activations (docs/codecs.md, "Low rank"); with ecsq gradients gpt-medium's default
RAVN_LOWRANK = ("--wire-forward", "lowrank", "--wire-backward", "int3_rot", "--wire-zstd", "on")
RAVN_LOWRANK_ECSQ = ("--wire-forward", "lowrank", "--wire-backward", "ecsq", "--wire-zstd", "on")
# a checkpoint's default (docs/codecs.md, "600 steps")
RAVN_INT4_ECSQ = ("--wire-forward", "int4_rot", "--wire-backward", "ecsq", "--wire-zstd", "on")
RAVN_MODES: dict[str, tuple[str, ...]] = {
    "sync fp32": RAVN_SYNC + RAVN_FP32,
    "async fp32": RAVN_ASYNC + RAVN_FP32,
    "sync int4_rot/int8": RAVN_SYNC + RAVN_CODECS,
    "async int4_rot/int8": RAVN_ASYNC + RAVN_CODECS,
    "sync int8/int8": RAVN_SYNC + RAVN_INT8,
    "sync bf16/bf16": RAVN_SYNC + RAVN_BF16,
    "sync int4_rot/int4_rot": RAVN_SYNC + RAVN_INT4,
    "sync int4_rot/int4_rot zstd": RAVN_SYNC + RAVN_INT4_ZSTD,
    "sync int3_rot/int3_rot zstd": RAVN_SYNC + RAVN_INT3_ZSTD,
    "sync int3_rot/ecsq zstd": RAVN_SYNC + RAVN_ECSQ,
    "sync lowrank/int3_rot zstd": RAVN_SYNC + RAVN_LOWRANK,
    "sync lowrank/ecsq zstd": RAVN_SYNC + RAVN_LOWRANK_ECSQ,
    "async int3_rot/int3_rot zstd": RAVN_ASYNC + RAVN_INT3_ZSTD,
    "async lowrank/ecsq zstd": RAVN_ASYNC + RAVN_LOWRANK_ECSQ,
    "async lowrank/ecsq zstd in-flight 4": RAVN_ASYNC + ("--max-in-flight", "4") + RAVN_LOWRANK_ECSQ,
    # before the measured window: all that S = 1 allows in flight, (S + 1) x the workload's 8 micro-batches
    "async int3_rot/int3_rot zstd in-flight 16": RAVN_ASYNC + ("--max-in-flight", "16") + RAVN_INT3_ZSTD,
    "async int8/int8": RAVN_ASYNC + RAVN_INT8,
    "sync int4_rot/ecsq zstd": RAVN_SYNC + RAVN_INT4_ECSQ,
    "async int4_rot/ecsq zstd": RAVN_ASYNC + RAVN_INT4_ECSQ,
    # async at sync's activation memory: in flight capped at the loss runs' K = 4 instead of (S + 1) x K
    "async int4_rot/ecsq zstd in-flight 4": RAVN_ASYNC + ("--max-in-flight", "4") + RAVN_INT4_ECSQ,
}


@dataclass(frozen=True)
class Workload:
    """Model, batch and run length; every system in a comparison trains exactly this."""

    model: str = "gpt-medium"  # a built-in preset, or a Hugging Face checkpoint's directory (LoRA fine-tuning)
    steps: int = 16
    micro_batches: int = 8
    micro_batch_size: int = 4
    eval_every: int = 4
    seed: int = 0
    lr: float = DEFAULT_LR  # Ravn's default recipe, which the torch baseline trains too (clipping per stage)
    grad_clip: float = DEFAULT_GRAD_CLIP
    timed_from: int = 0  # steps before this are trained but not timed (the async schedule's sync warm-up)
    data: str | None = None  # --data (default: the standard library's source)
    dtype: str | None = None  # a checkpoint's --dtype
    train_samples: int = 0  # --train-samples: a fixed set seen epoch after epoch (0: the stream)

    @property
    def context(self) -> int:
        if self.model in MODEL_PRESETS:
            return MODEL_PRESETS[self.model].context
        from swarm.train.hf.checkpoint_check import default_context

        return default_context(self.model)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.context

    def ravn_args(self, mode: Sequence[str]) -> list[str]:
        """``ravn-coordinator serve`` training flags; eval batches = micro-batches, as the torch run uses.

        Fault-tolerance checkpoints are off: they ship every stage's weights and optimizer state to the
        coordinator every C steps, which PyTorch's pipelining has no counterpart for.
        """
        return [
            "--model", self.model,
            "--steps", str(self.steps),
            "--micro-batches", str(self.micro_batches),
            "--micro-batch-size", str(self.micro_batch_size),
            "--eval-every", str(self.eval_every),
            "--eval-batches", str(self.micro_batches),
            "--seed", str(self.seed),
            "--lr", str(self.lr),
            "--grad-clip", str(self.grad_clip),
            "--checkpoint-every", "0",
            *(["--data", self.data] if self.data else []),
            *(["--dtype", self.dtype] if self.dtype else []),
            *(["--train-samples", str(self.train_samples)] if self.train_samples else []),
            *mode,
        ]  # fmt: skip


def cap_links(cap: str) -> list[LinkProfile]:
    return [parse_link(spec) for spec in CAPS[cap]]


@dataclass
class RunRecord:
    """One training run, reduced to what the tables and plots need."""

    system: str  # "ravn" or "torch"
    mode: str  # e.g. "sync fp32", "GPipe fp32"
    cap: str
    tokens: int
    train_s: float
    final_val_loss: float
    evals: list[tuple[float, int, float]]  # (seconds since training start, tokens trained, loss)
    host_bytes: dict[str, dict[str, int]]  # peer -> {"up": tx bytes, "down": rx bytes} in the window
    payload_bytes_per_token: float | None = None  # Ravn's own count of bytes it handed to gRPC
    stages: list[dict] = field(default_factory=list)  # Ravn's per-stage summary (bubble, staleness)
    blocks: dict[str, list[int]] = field(default_factory=dict)  # peer -> [layer_start, layer_end)
    step_ends: list[float] = field(default_factory=list)  # seconds from training start to each step's end
    step_losses: list[float] = field(default_factory=list)  # training loss of each step
    startup_s: float = 0.0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)  # 1/5/15-minute load averages at the end
    cpu_per_peer: float | None = None  # each peer's own CPU share in cores (None: all share the machine)
    cpu_throttled: dict[str, float] = field(default_factory=dict)  # peer -> share of periods its cap held it back

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s > 0 else 0.0

    @property
    def wire_bytes_per_token(self) -> float:
        return sum(b["up"] for b in self.host_bytes.values()) / max(self.tokens, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "wire_bytes_per_token": self.wire_bytes_per_token}

    @classmethod
    def from_dict(cls, d: dict) -> RunRecord:
        keep = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        keep["evals"] = [tuple(e) for e in keep["evals"]]
        keep["load"] = tuple(keep.get("load", (0.0, 0.0, 0.0)))
        return cls(**keep)


def plan_text(record: RunRecord) -> str:
    """Which peer held which layers, in stage order, e.g. ``p0:0-2 p1:2-4 p2:4-6``."""
    order = sorted(record.blocks.items(), key=lambda kv: kv[1][0])
    return " ".join(f"{peer}:{a}-{b}" for peer, (a, b) in order)


def link_bound_tokens_per_s(record: RunRecord, links: Sequence[LinkProfile]) -> float:
    """Tokens/s the caps allow for this run's measured traffic: the busiest link direction decides.

    Each direction of each peer's access link moves ``bytes / token`` (measured, headers included)
    through a shaper of ``cap`` bytes/s, so it allows ``cap / (bytes / token)`` tokens/s.
    """
    best = float("inf")
    for i, link in enumerate(links):
        moved = record.host_bytes.get(f"p{i}", {})
        for direction, mbit in (("up", link.up_mbit), ("down", link.down_mbit)):
            per_token = moved.get(direction, 0) / max(record.tokens, 1)
            if mbit is not None and per_token > 0:
                best = min(best, mbit * 1e6 / 8 / per_token)
    return best


def busiest_link(record: RunRecord, links: Sequence[LinkProfile]) -> tuple[float, str]:
    """Bytes per token on the link direction with the least time to spare, and which one (``p1 up``).

    Uncapped directions rank below every capped one, the largest of them first.
    """
    best, out = None, (0.0, "-")
    for i, link in enumerate(links):
        for direction, mbit in (("up", link.up_mbit), ("down", link.down_mbit)):
            per_token = record.host_bytes.get(f"p{i}", {}).get(direction, 0) / max(record.tokens, 1)
            key = per_token / mbit if mbit else per_token * 1e-9
            if best is None or key > best:
                best, out = key, (per_token, f"p{i} {direction}")
    return out


# ---- traffic counters -------------------------------------------------------------------------


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _eth0_bytes(pid: int) -> tuple[int, int]:
    """(rx, tx) bytes of eth0 in the network namespace of ``pid``."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no eth0 in the namespace of pid {pid}")


class NetSampler:
    """Samples every peer's eth0 counters a few times a second, for byte counts over any time window.

    The counters are read through ``/proc/<pid>/net/dev`` of one idle ``sleep`` per namespace, so
    sampling spawns nothing and costs microseconds, and works for any process in the namespace
    (Ravn's gRPC, gloo) without its cooperation.
    """

    def __init__(self, hosts: Sequence[Host], period_s: float = 0.1) -> None:
        self.hosts, self.period_s = list(hosts), period_s
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._anchors: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> NetSampler:
        for host in self.hosts:
            self._anchors.append(host.popen(["sleep", "86400"]))
        for host, proc in zip(self.hosts, self._anchors, strict=True):
            want = os.stat(f"/run/netns/{host.netns}").st_ino
            deadline = time.monotonic() + 10
            while _netns_inode(proc.pid) != want:  # `ip netns exec` has not exec'd into sleep yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"counter anchor for {host.name} never entered its namespace")
                time.sleep(0.01)
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for proc in self._anchors:
            proc.terminate()
            proc.wait()

    def _sample(self) -> None:
        now = time.time()
        counts = {h.name: _eth0_bytes(p.pid) for h, p in zip(self.hosts, self._anchors, strict=True)}
        self.samples.append((now, counts))

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def at(self, t: float) -> dict[str, tuple[float, float]]:
        """Counters at wall-clock time ``t``, linearly interpolated between samples."""
        times = [s[0] for s in self.samples]
        i = min(max(bisect_left(times, t), 1), len(times) - 1)
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        w = 0.0 if t1 == t0 else min(max((t - t0) / (t1 - t0), 0.0), 1.0)
        return {h: tuple(a + w * (b - a) for a, b in zip(c0[h], c1[h], strict=True)) for h in c0}

    def window(self, start: float, end: float) -> dict[str, dict[str, int]]:
        a, b = self.at(start), self.at(end)
        return {h: {"down": round(b[h][0] - a[h][0]), "up": round(b[h][1] - a[h][1])} for h in a}


# ---- Ravn ---------------------------------------------------------------------------------------


def run_ravn(lab: Lab, cap: str, mode: str, workload: Workload, runs_dir: Path) -> RunRecord:
    """One Ravn swarm in ``lab``: metrics from its ``metrics.jsonl``, bytes from the namespaces."""
    name = f"{cap}-{mode}".replace(" ", "-").replace("/", "-")
    runs_dir.mkdir(parents=True, exist_ok=True)
    with NetSampler(lab.peers) as sampler:
        result = run_swarm(lab, name, runs_dir, workload.ravn_args(RAVN_MODES[mode]))
    summary = result.summary
    steps = [s for s in result.steps if s["step"] >= workload.timed_from] or result.steps
    start = steps[0]["time"] - steps[0]["seconds"]  # the data source's clock starts with training
    end = steps[-1]["time"]
    tokens = sum(s["tokens"] for s in steps)
    evals = [(e["time"] - start, (e["step"] + 1) * workload.tokens_per_step, e["loss"]) for e in result.evals]
    return RunRecord(
        system="ravn",
        mode=mode,
        cap=cap,
        tokens=tokens,
        train_s=sum(s["seconds"] for s in steps),
        final_val_loss=summary["final_val_loss"],
        evals=evals,
        host_bytes=sampler.window(start, end),
        payload_bytes_per_token=summary["wire_bytes_per_token"],
        stages=summary["stages"],
        blocks={m["peer"]: m["layers"] for m in result.metrics if m["kind"] == "assign"},
        step_ends=[s["time"] - start for s in result.steps],
        step_losses=[s["loss"] for s in result.steps],
        startup_s=result.wall_s - (end - start),
        load=os.getloadavg(),
        cpu_per_peer=lab.cpu_per_peer,
        cpu_throttled={h.name: round(h.cpu.throttled_fraction(), 3) for h in lab.peers if h.cpu},
    )


# ---- the machine --------------------------------------------------------------------------------


def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 30.0) -> tuple[float, float, float]:
    """Wait (bounded) until the 1-minute load average is at most ``max_load``; returns the load then.

    The machine is shared and has two cores, so a neighbour's test run can halve any number here.
    """
    deadline = time.monotonic() + max_wait_s
    load = os.getloadavg()
    while load[0] > max_load and time.monotonic() < deadline:
        print(f"load {load[0]:.2f} > {max_load}: waiting {poll_s:.0f} s for a quieter machine", flush=True)
        time.sleep(poll_s)
        load = os.getloadavg()
    return load


def stage_compute_seconds(workload: Workload, n_stages: int, rounds: int = 12) -> list[float]:
    """Forward + backward of one micro-batch per stage, alone on one thread (optimizer step amortised).

    Stages are timed round-robin and each keeps its median, so a burst of load from a neighbour
    lands on all stages alike instead of inflating one of them.
    """
    import statistics

    import torch

    from swarm.train.model import StageModel, even_split

    cfg = MODEL_PRESETS[workload.model]
    b, t = workload.micro_batch_size, cfg.context
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stages = []
        for start, end in even_split(cfg.n_layers, n_stages):
            model = StageModel(cfg, start, end)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
            x = torch.randint(0, cfg.vocab_size, (b, t)) if start == 0 else torch.randn(b, t, cfg.d_model)
            stages.append((model, opt, x, torch.randint(0, cfg.vocab_size, (b, t))))

        def once(model: StageModel, x: torch.Tensor, y: torch.Tensor) -> None:
            h = x if model.is_first else x.detach().requires_grad_(True)
            out = model(h)
            if model.is_last:
                (model.loss_sum(out, y) / workload.tokens_per_step).backward()
            else:
                out.backward(torch.full_like(out, 1e-3))

        times: list[list[float]] = [[] for _ in stages]
        for round_ in range(rounds + 2):  # two warm-up rounds
            for i, (model, _, x, y) in enumerate(stages):
                t0 = time.perf_counter()
                once(model, x, y)
                if round_ >= 2:
                    times[i].append(time.perf_counter() - t0)
        out = []
        for (_, opt, _, _), ts in zip(stages, times, strict=True):
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(statistics.median(ts) + (time.perf_counter() - t0) / workload.micro_batches)
        return out
    finally:
        torch.set_num_threads(threads)


def compute_bound_tokens_per_s(stage_s: Sequence[float], tokens_per_mb: int, cores: int) -> float:
    """Best pipelined throughput of these stage times: the slowest stage, or all stages sharing the cores."""
    return tokens_per_mb / max(max(stage_s), sum(stage_s) / cores)


# ---- plots --------------------------------------------------------------------------------------


def plot_loss_vs_time(records: Sequence[RunRecord], caps: Sequence[str], path: Path, title: str) -> None:
    """Validation loss against wall-clock seconds of training, one panel per cap, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(caps), figsize=(max(4.6 * len(caps), 7.0), 4.2), squeeze=False)
    mixed = len({r.system for r in records}) > 1
    for ax, cap in zip(axes[0], caps, strict=True):
        for r in (r for r in records if r.cap == cap):
            label = f"torch {r.mode}" if r.system == "torch" else f"Ravn {r.mode}" if mixed else r.mode
            style = "s--" if r.system == "torch" else "o-"
            ax.plot([e[0] for e in r.evals], [e[2] for e in r.evals], style, ms=3, label=label)
        ax.set_title(f"{cap}: {', '.join(dict.fromkeys(CAPS[cap]))}" if cap == "mix" else cap, fontsize=10)
        ax.set_xlabel("wall-clock seconds of training")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (nats/token)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
