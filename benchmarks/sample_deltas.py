"""What activation deltas cost each end of a link: time per micro-batch, with rows in memory or on disk.

A delta is more work than the activation alone. The sender reads the samples' rows, encodes the change,
decodes it as the receiver will and writes the rows back; the receiver reads, adds and writes. This times
both ends against the link's own codec on the same tensors, on one core as in ``benchmarks/codecs.py``
(a volunteer PC spends its other cores on the model), for a micro-batch of gpt-medium's boundary and
for one 2,048-token sequence of a model 8,192 wide (a 70B's), with the rows in memory and spilled to
disk (a file in ``--spill-dir``, which the page cache may hold: the figure is the copy, not the drive).

Run: ``python -m benchmarks.sample_deltas``; prints a table and writes ``benchmarks/out/sample_deltas.md``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.entropy import median_seconds
from swarm.pb import wire_pb2 as pb
from swarm.wire.codec_policy import WirePolicy
from swarm.wire.packets import tensor_from_pb
from swarm.wire.sample_deltas import DeltaReceiver, DeltaSender
from swarm.wire.sample_store import SampleStore

SHAPES = {"gpt-medium micro-batch": (4, 128, 256), "70B sequence": (1, 2048, 8192)}
OUT = Path(__file__).resolve().parent / "out" / "sample_deltas.md"


def _median_ms(fn, repeats: int) -> float:
    return 1e3 * median_seconds(fn, repeats)


def measure(shape: tuple[int, ...], forward: str, delta: str, spill_dir: str | None, repeats: int) -> dict:
    """Median ms per micro-batch: the link's codec alone, and a delta at each end (rows on disk if ``spill_dir``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    x[..., :4] *= 30  # a few massive channels, as trained boundaries have
    drift = 0.05 * torch.randn(shape, generator=g)
    samples = list(range(shape[0]))
    row_bytes = 2 * x[0].numel()
    memory, spill = (0, row_bytes * len(samples)) if spill_dir else (row_bytes * len(samples), 0)
    policy = WirePolicy(forward=forward, zstd=True)
    sender = DeltaSender(SampleStore(memory, spill, spill_dir))
    receiver = DeltaReceiver(SampleStore(memory, spill, spill_dir))

    def send(hidden: torch.Tensor, rows: DeltaSender | None) -> pb.Activations:
        return policy.activations(pb.MicroBatch(id=1, samples=samples), hidden, None, rows, delta).activations

    first = send(x, sender)  # the first visit stores the rows at both ends
    receiver.commit(first, receiver.rebuild(first, tensor_from_pb(first.hidden)))
    later = x + drift
    act = send(later, sender)
    plain = send(later, None)
    decoded = tensor_from_pb(act.hidden)

    def receive() -> None:
        receiver.commit(act, receiver.rebuild(act, decoded))

    return {
        "plain_ms": _median_ms(lambda: send(later, None), repeats),
        "send_ms": _median_ms(lambda: send(later, sender), repeats),
        "receive_ms": _median_ms(receive, repeats),
        "decode_ms": _median_ms(lambda: tensor_from_pb(act.hidden), repeats),
        "plain_bytes": len(plain.hidden.payload) + len(plain.hidden.scales),
        "delta_bytes": len(act.hidden.payload) + len(act.hidden.scales),
        "mb": x.numel() * 4 / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward", default="int4_rot", help="the link's own codec")
    parser.add_argument("--delta", default="int3_rot", help="the deltas' codec")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--spill-dir", default=None, help="folder of the spilled rows (default: the temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        f"forward {args.forward}, deltas {args.delta}, one core, median of {args.repeats}; ms per micro-batch",
        "",
        "| tensor | rows | fp32 MB | link's codec | delta: send | receive (+ decode) | bytes: codec → delta |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, shape in SHAPES.items():
        for where in ("memory", "disk"):
            with tempfile.TemporaryDirectory(dir=args.spill_dir) as d:
                r = measure(shape, args.forward, args.delta, d if where == "disk" else None, args.repeats)
            lines.append(
                f"| {name} {shape} | {where} | {r['mb']:.1f} | {r['plain_ms']:.2f} | {r['send_ms']:.2f} | "
                f"{r['receive_ms']:.2f} (+ {r['decode_ms']:.2f}) | {r['plain_bytes']:,} → {r['delta_bytes']:,} |"
            )
    print("\n".join(lines))
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
