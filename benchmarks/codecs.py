"""Benchmark the wire codecs: bytes on the wire, error, and single-core speed on 64 MiB tensors.

Why these tensors: activations of a transformer are roughly Gaussian except for a handful of
channels that are 10-100x larger (the "massive activations" of GPT-style models), which is exactly
what hurts blockwise absmax quantisation; gradients w.r.t. hidden states are small and heavy-tailed.
Throughput is reported as GB/s of float32 input (``numel * 4 / seconds``), the median of a few runs
(the best is printed too: on a shared machine the median says what a busy peer sees, the best what
the code can do), with ``torch.set_num_threads(1)`` because a volunteer PC spends its other cores on
the model. ``enc+dec GB/s`` is ``numel * 4 / (t_encode + t_decode)``, the figure the target of issue
#19 is stated in (>= 2 GB/s); rows that meet it are marked.

``int4_rot+zstd``, ``int3_rot+zstd`` and ``ecsq+rows`` are those codecs as the wire sends them (``--wire-zstd on``,
the default): encode plus the lossless coding into the wire message (``encoded_to_pb``: zstd over the 4-bit codes
and their scales, ecsq's codes entropy-coded by rows), and back (``tensor_from_pb``), so they include protobuf's copy
of the payload. How much the coding takes off depends on the data: these synthetic tensors compress less than
trained boundaries do.

``lowrank`` and ``ecsq`` see each tensor as the ``tokens x d_model`` matrix a boundary is (``D_MODEL`` columns):
the row coder codes its rows (before 2026-12-06 ``ecsq+rows`` coded the flat tensor as one row of 16 M codes,
which no boundary sends). ``lowrank`` sends it at the wire's default rank. Its time is the matrix products of the
subspace iteration, not the values' coding; its error here says little, since only the synthetic activations'
outlier channels are low-rank.

Peers run with ``THP_MEM_ALLOC_ENABLE=1`` (``swarm/allocator.py``): half of a decode into a fresh
64 MiB tensor is page faults without it. The benchmark therefore re-executes itself with that variable
set unless ``--no-thp`` is given, and says which in the header.

Run: ``python benchmarks/codecs.py`` (``--help`` for options). Prints a table, writes
``benchmarks/out/codecs.md`` (the same table in Markdown) and ``benchmarks/out/codecs.png``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.wire.codecs import decode, encode
from swarm.wire.packets import encoded_to_pb, tensor_from_pb

CODECS = (
    *("fp32", "fp16", "bf16", "int8", "int4", "int4_rot", "int3_rot", "ecsq"),
    *("lowrank", "int4_rot+zstd", "int3_rot+zstd", "ecsq+rows"),
)
D_MODEL = 1024  # the synthetic tensors' row width, as ``lowrank`` sees them
TARGET_GBS = 2.0  # encode + decode, GB/s of float32 input (issue #19)
OUT_DIR = Path(__file__).resolve().parent / "out"


def activation_like(numel: int, d_model: int = D_MODEL, seed: int = 0) -> torch.Tensor:
    """GPT-style hidden states: N(0, 1) with 4 outlier channels scaled 20-100x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel // d_model, d_model, generator=g)
    channels = torch.randperm(d_model, generator=g)[:4]
    x[:, channels] *= torch.tensor([20.0, 40.0, 60.0, 100.0])
    return x.reshape(-1)


def gradient_like(numel: int, scale: float = 1e-3, seed: int = 1) -> torch.Tensor:
    """Small, heavy-tailed values: Student-t with 3 degrees of freedom times ``scale``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    chi2 = torch.zeros(numel)
    for _ in range(3):
        chi2.add_(torch.randn(numel, generator=g).square_())
    return x.div_(chi2.div_(3).sqrt_().clamp_min_(1e-3)).mul_(scale)


@dataclass
class Row:
    tensor: str
    codec: str
    ratio: float  # bytes on the wire / float32 bytes
    rel_err: float  # ||x - x'|| / ||x||
    gb: float  # GB of float32 input
    enc_s: float  # median encode time
    dec_s: float  # median decode time
    enc_best_s: float = 0.0
    dec_best_s: float = 0.0

    @property
    def enc_gbs(self) -> float:
        return self.gb / self.enc_s

    @property
    def dec_gbs(self) -> float:
        return self.gb / self.dec_s

    @property
    def both_gbs(self) -> float:
        return self.gb / (self.enc_s + self.dec_s)

    @property
    def best_both_gbs(self) -> float:
        return self.gb / (self.enc_best_s + self.dec_best_s) if self.enc_best_s else float("nan")

    @property
    def meets(self) -> str:
        return "yes" if self.both_gbs >= TARGET_GBS else "no"

    @property
    def total_ms(self) -> float:
        return (self.enc_s + self.dec_s) * 1e3


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def times(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, best) time of ``fn`` over ``repeats`` runs, each after a garbage collection."""
    runs = []
    for _ in range(repeats):
        gc.collect()
        start = clock()
        result = fn()
        runs.append(clock() - start)
        del result
    return statistics.median(runs), min(runs)


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y.float()).norm() / x.norm())


def measure(name: str, x: torch.Tensor, label: str, repeats: int, block_size: int) -> Row:
    """One row; ``label`` is a codec, or ``codec+zstd`` / ``codec+rows`` for the coded wire message (see the
    docstring)."""
    codec, _, coded = label.partition("+")
    options = {"block_size": block_size, "seed": 1234}
    if codec in ("lowrank", "ecsq"):  # a boundary's tokens x d_model matrix: lowrank factors it, rows code its rows
        x = x.view(-1, D_MODEL)
    if name == "gradients":  # as a stage sends them: fp32 scales first where its last gradient needed them
        options["small"] = len(encode(x, codec, **options).scales) == 4 * -(-x.numel() // block_size)
    if coded:

        def enc_fn() -> object:
            return encoded_to_pb(encode(x, codec, **options), zstd=True)

        def dec_fn(msg: object) -> torch.Tensor:
            return tensor_from_pb(msg, max_elements=x.numel())

        def nbytes(msg: object) -> int:
            return len(msg.payload) + len(msg.scales)
    else:

        def enc_fn() -> object:
            return encode(x, codec, **options)

        dec_fn = decode

        def nbytes(enc: object) -> int:
            return enc.nbytes

    enc = enc_fn()
    err = rel_err(x, dec_fn(enc))
    gb = x.numel() * 4 / 1e9
    t_enc, b_enc = times(enc_fn, repeats)
    t_dec, b_dec = times(lambda: dec_fn(enc), repeats)
    return Row(name, label, nbytes(enc) / (x.numel() * 4), err, gb, t_enc, t_dec, b_enc, b_dec)


def rotation_floor(x: torch.Tensor, block_size: int, repeats: int) -> tuple[float, float]:
    """(median ms, GFLOP/s) of the rotated codecs' rotation alone over ``x``, one direction.

    It is the same dense ``block x block`` matmul per chunk that ``quantize`` runs (signs folded in),
    without any of the quantisation around it: twice this (encode and decode) is a floor under every
    rotated codec's encode + decode, whatever the rest costs.
    """
    from swarm.wire.hadamard import BlockRotation
    from swarm.wire.quantize import CPU_CHUNK_ELEMS

    rotation = BlockRotation(1234, block_size)
    rows = CPU_CHUNK_ELEMS // block_size
    blocks = x[: x.numel() // block_size * block_size].view(-1, block_size)
    out, spare = torch.empty(rows, block_size), torch.empty(rows, block_size)

    def run() -> None:
        for chunk in blocks.split(rows):
            k = chunk.shape[0]
            rotation.forward(chunk, out[:k], spare[:k])

    median, _ = times(run, repeats)
    return median * 1e3, 2 * blocks.numel() * block_size / median / 1e9


def measure_hivemind(name: str, x: torch.Tensor, repeats: int) -> list[Row]:
    """The same numbers for hivemind's own codecs, for scale (skipped if hivemind is not importable)."""
    try:
        from hivemind.compression import CompressionInfo, Float16Compression, Uniform8BitQuantization
    except ImportError:
        return []
    rows = []
    gb = x.numel() * 4 / 1e9
    for label, comp in (("hivemind fp16", Float16Compression()), ("hivemind uint8", Uniform8BitQuantization())):
        info = CompressionInfo.from_tensor(x)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch deprecates the quantized dtypes hivemind uses
                msg = comp.compress(x, info)
                err = rel_err(x, comp.extract(msg))
        except Exception as e:  # e.g. hivemind 1.1.12's uint8 extract fails under numpy 2
            print(f"skipping {label}: {type(e).__name__}: {e}")
            continue
        t_enc, b_enc = times(lambda comp=comp, info=info: comp.compress(x, info), repeats)
        t_dec, b_dec = times(lambda comp=comp, msg=msg: comp.extract(msg), repeats)
        rows.append(Row(name, label, len(msg.buffer) / (x.numel() * 4), err, gb, t_enc, t_dec, b_enc, b_dec))
    return rows


def markdown(rows: list[Row], header: str) -> str:
    lines = [
        header,
        "",
        "| tensor | codec | bytes / fp32 | rel. error | encode GB/s | decode GB/s | enc+dec GB/s "
        f"| (best) | enc+dec ms | >= {TARGET_GBS:g} GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(cells(r)) + " |")
    return "\n".join(lines) + "\n"


COLUMNS = (
    "tensor",
    "codec",
    "bytes / fp32",
    "rel. error",
    "encode GB/s",
    "decode GB/s",
    "enc+dec GB/s",
    "(best)",
    "enc+dec ms",
    f">= {TARGET_GBS:g} GB/s",
)


def cells(r: Row) -> list[str]:
    return [
        r.tensor,
        r.codec,
        f"{r.ratio:.4f}",
        f"{r.rel_err:.2e}",
        f"{r.enc_gbs:.2f}",
        f"{r.dec_gbs:.2f}",
        f"{r.both_gbs:.2f}",
        f"{r.best_both_gbs:.2f}",
        f"{r.total_ms:.1f}",
        r.meets,
    ]


def print_table(rows: list[Row], header: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(markdown(rows, header))
        return
    table = Table(title=header)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("tensor", "codec") else "right", no_wrap=True)
    for r in rows:
        table.add_row(*cells(r))
    Console(width=200).print(table)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_err, ax_speed) = plt.subplots(1, 2, figsize=(14, 5.5))
    colours = {"activations": "tab:blue", "gradients": "tab:orange"}
    for kind, colour in colours.items():
        pts = [r for r in rows if r.tensor == kind and r.rel_err > 0]
        ax_err.scatter([r.ratio for r in pts], [r.rel_err for r in pts], color=colour, label=kind)
        for r in pts:
            dy = 6 if kind == "activations" else -12
            ax_err.annotate(r.codec, (r.ratio, r.rel_err), fontsize=8, xytext=(4, dy), textcoords="offset points")
    ax_err.set_xscale("log")
    ax_err.set_yscale("log")
    ax_err.set_xlabel("bytes on the wire / float32 bytes")
    ax_err.set_ylabel("relative L2 error ||x - x'|| / ||x||")
    ax_err.set_title("Size vs error (fp32 is exact, not shown)")
    ax_err.legend()
    acts = [r for r in rows if r.tensor == "activations"]
    idx = range(len(acts))
    width = 0.27
    ax_speed.bar([i - width for i in idx], [r.enc_gbs for r in acts], width=width, label="encode")
    ax_speed.bar(list(idx), [r.dec_gbs for r in acts], width=width, label="decode")
    both = [r.gb / (r.enc_s + r.dec_s) for r in acts]
    ax_speed.bar([i + width for i in idx], both, width=width, label="encode + decode")
    ax_speed.axhline(TARGET_GBS, color="grey", linestyle="--", linewidth=1)
    ax_speed.set_xticks(list(idx), [r.codec for r in acts], rotation=30, ha="right")
    ax_speed.set_ylabel("GB/s of float32 input, 1 core")
    ax_speed.set_title(f"Throughput on activations (median of runs; dashed: {TARGET_GBS:g} GB/s)")
    ax_speed.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="size of each float32 test tensor in MiB")
    parser.add_argument("--repeats", type=int, default=7, help="runs per measurement; median and best are kept")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument(
        "--gradient-scale",
        type=float,
        default=1e-3,
        help="scale of the gradient-like tensor (gradients w.r.t. hidden states are ~1e-7 in training)",
    )
    parser.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baseline rows")
    parser.add_argument("--no-thp", action="store_true", help="do not set THP_MEM_ALLOC_ENABLE=1 (peers do)")
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="wall time (the official figure) or this thread's CPU time (steadier on a shared machine: "
        "time slices lost to other jobs do not count, cache and memory contention still do)",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if not args.no_thp and os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
        # torch reads it once, at its first allocation: only a fresh process can turn it on
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"})

    torch.set_num_threads(args.threads)
    numel = args.mib * (1 << 20) // 4
    tensors = {"activations": activation_like(numel), "gradients": gradient_like(numel, args.gradient_scale)}
    rows: list[Row] = []
    for name, x in tensors.items():
        for codec in args.codecs:
            rows.append(measure(name, x, codec, args.repeats, args.block_size))
        if not args.no_hivemind:
            rows.extend(measure_hivemind(name, x, max(1, args.repeats // 2)))

    header = (
        f"{args.mib} MiB float32 tensors (gradients x {args.gradient_scale:g}), block {args.block_size}, "
        f"{args.threads} thread(s), median (and best) "
        f"of {args.repeats}, {args.clock} clock; "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, "
        f"torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.1f}"
    )
    print_table(rows, header)
    if any(c.partition("+")[0] in ("int4_rot", "int3_rot") for c in args.codecs):
        ms, gflops = rotation_floor(tensors["activations"], args.block_size, args.repeats)
        budget = numel * 4 / 1e9 / TARGET_GBS * 1e3
        print(
            f"rotation alone ({args.block_size}x{args.block_size} matmul per block, one direction): {ms:.1f} ms "
            f"median at {gflops:.0f} GFLOP/s; encode + decode rotate twice, {2 * ms:.1f} ms against the "
            f"{budget:.1f} ms that {TARGET_GBS:g} GB/s allows for everything"
        )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "codecs.md").write_text(markdown(rows, header))
    if not args.no_plot:
        plot(rows, OUT_DIR / "codecs.png")
    print(f"wrote {OUT_DIR / 'codecs.md'}" + ("" if args.no_plot else f" and {OUT_DIR / 'codecs.png'}"))


if __name__ == "__main__":
    main()
