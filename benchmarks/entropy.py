"""How much zstd takes off each codec's payload on real boundary tensors, and what it costs on one core.

Why real tensors: how far quantised codes are from uniform depends on what training does to the
activations (a few channels grow large, blocks become peaked), which random tensors do not show. The
benchmark trains gpt-medium unsplit in this process (AdamW, the swarm's recipe, one batch of 32 x 128 per
step) and, at the steps asked for, keeps the output of layers 1 and 3 (the boundaries of a 3-peer split)
and the gradient of the loss w.r.t. them, for one micro-batch of 4 x 128 as the wire carries it. Each is
encoded with each codec (gradients with the fp32-scale hint, as a stage sends them) and its payload
zstd-compressed; the scales of the 4-bit codecs are coded as the wire codes them (byte planes,
``swarm.wire.entropy.compress_planes``), the others' stay raw. The table gives payload + scales coded over
plain, the relative error ``||decode - x|| / ||x||``, the coded bytes per token (one token is one row of
``d_model`` values) and the single-core speeds (median of ``--repeats``, MB/s of plain payload).

Two yardsticks say what is left to gain. ``bound`` is the least relative error that any code of the same
coded bits per value ``R`` reaches on an i.i.d. Gaussian source of the same power, ``2**-R`` (Shannon's
distortion-rate function, ``D(R) = sigma**2 * 2**(-2R)``). The Gaussian is the hardest source of a given
power to compress, so this is what a perfect codec is sure of on any data; a codec whose error is below
it is already living off the data's structure (zstd finds some in the codes), one far above it wastes bits
even on noise. The structure itself is in the second table: the share of a tensor's energy (its squared
Frobenius norm, as a ``tokens x d_model`` matrix) in its top 8, 16, 32 and 64 singular directions, and in
its mean row. A matrix whose energy sits in a few directions can be sent in far fewer bytes than its
entries one by one (the ``lowrank`` codec), at an error no value-by-value codec of that size reaches.

Run: ``PYTHONPATH=. python -m benchmarks.entropy`` (alone on the machine for the speeds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import zstandard

from swarm.config import MODEL_PRESETS
from swarm.train.data import Corpus
from swarm.train.model import full_model
from swarm.wire import entropy
from swarm.wire.codecs import decode, encode
from swarm.wire.quantize import num_blocks

BOUNDARIES = (1, 3)  # the outputs of a 3-peer split of 6 layers


def capture(steps: list[int], *, seed: int = 0) -> dict[tuple[int, int, str], torch.Tensor]:
    torch.manual_seed(seed)
    cfg = MODEL_PRESETS["gpt-medium"]
    model = full_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = Corpus.load()
    kept: dict[tuple[int, int, str], torch.Tensor] = {}
    for step in range(max(steps) + 1):
        outs: dict[int, torch.Tensor] = {}
        hooks = []
        if step in steps:
            for i in BOUNDARIES:

                def keep(_m, _inp, out, i=i, outs=outs):
                    out.retain_grad()
                    outs[i] = out

                hooks.append(model.layers[str(i)].register_forward_hook(keep))
        x, y = corpus.batch(split="train", seed=seed, step=step, index=0, batch_size=32, context=cfg.context)
        loss = model.loss_sum(model(x), y) / y.numel()
        loss.backward()
        for h in hooks:
            h.remove()
        for i, out in outs.items():
            kept[(step, i, "activations")] = out[:4].detach().clone()
            kept[(step, i, "gradients")] = out.grad[:4].detach().clone()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    return kept


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, nargs="+", default=[0, 300], help="training steps at which to capture")
    p.add_argument("--codecs", nargs="+", default=["bf16", "int8", "int4_rot", "int3_rot"])
    p.add_argument("--level", type=int, default=1, help="zstd level (swarm/wire/entropy.py uses 1)")
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tensors = capture(sorted(set(args.steps)))
    comp, dec = zstandard.ZstdCompressor(level=args.level, write_content_size=True), zstandard.ZstdDecompressor()
    print(f"\nzstd level {args.level}, one core; payload + scales coded/plain; MB/s of plain payload, median")
    print(
        "| step | boundary | tensor | codec | rel. error | bound | plain B/value | coded / plain "
        "| scales coded / plain | coded B/token | compress MB/s | decompress MB/s |"
    )
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (step, i, kind), x in sorted(tensors.items()):
        for codec in args.codecs:
            enc = encode(x, codec, small=kind == "gradients")
            raw, plain = enc.payload, len(enc.payload) + len(enc.scales)
            err = float((decode(enc) - x).norm() / x.norm())
            z = comp.compress(raw)
            planes = entropy.compress_planes(enc.scales, num_blocks(x.numel(), enc.block_size) if enc.block_size else 0)
            scales = len(enc.scales) if planes is None or codec not in entropy.CODED else len(planes)
            per_token = (len(z) + scales) / (x.numel() // x.shape[-1])
            bound = gaussian_bound(8 * (len(z) + scales) / x.numel())
            c = median_seconds(lambda raw=raw: comp.compress(raw), args.repeats)
            d = median_seconds(lambda z=z: dec.decompress(z), args.repeats)
            print(
                f"| {step} | {i} | {kind} | {codec} | {err:.4f} | {bound:.4f} | {plain / x.numel():.3f} "
                f"| {(len(z) + scales) / plain:.3f} | {scales / max(len(enc.scales), 1):.3f} | {per_token:.1f} "
                f"| {len(raw) / c / 1e6:,.0f} | {len(raw) / d / 1e6:,.0f} |"
            )

    print(
        "\nshare of the energy in the top k singular directions of each tensor (tokens x d_model), and in its mean row"
    )
    print("| step | boundary | tensor | k = 8 | 16 | 32 | 64 | mean row |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for (step, i, kind), x in sorted(tensors.items()):
        shares = energy_shares(x, (8, 16, 32, 64))
        m = x.reshape(-1, x.shape[-1]).double()
        mean_row = float(m.mean(0).square().sum() * m.shape[0] / m.square().sum())
        print(f"| {step} | {i} | {kind} | " + " | ".join(f"{v:.3f}" for v in shares) + f" | {mean_row:.3f} |")


def gaussian_bound(bits_per_value: float) -> float:
    """The least relative L2 error of any code of this rate on an i.i.d. Gaussian source: ``2**-R``."""
    return 2.0**-bits_per_value


def energy_shares(x: torch.Tensor, ks: tuple[int, ...]) -> list[float]:
    """Share of ``||x||_F**2`` in the top ``k`` singular directions of ``x`` as a ``rows x last-dim`` matrix."""
    s = torch.linalg.svdvals(x.reshape(-1, x.shape[-1]).double()).square()
    total = float(s.sum())
    return [float(s[:k].sum()) / total for k in ks]


if __name__ == "__main__":
    main()
