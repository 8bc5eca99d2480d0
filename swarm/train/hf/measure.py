"""Measure HF blocks: a peer's layer throughput on the planned checkpoint, and the numbers in docs/finetune.md.

:func:`hf_layer_throughput` is what a peer runs before it joins (``swarm.train.measure.planned_throughput``):
one decoder layer of the checkpoint's own architecture, built from its ``config.json`` with random
weights (speed does not depend on the values, and a peer must not read gigabytes to start), in the run's
dtype, with the int8 / NF4 base, activation checkpointing and LoRA adapters the run trains, forward and
backward like a middle stage.

The command line reproduces docs/finetune.md: memory of a block (weights per storage mode, and the activations
one micro-batch keeps with and without activation checkpointing) and logits error of bf16 / int8 / NF4 vs fp32.

    python -m swarm.train.hf.measure PATH --split 0:2,2:4        # a real local checkpoint
    python -m swarm.train.hf.measure /tmp/rand --random llama --hidden 2048 --layers 4

Each block's peak resident memory is measured in a fresh child process (growth of Linux's VmHWM while
building the block), which is how "a peer never materialises the whole model" is checked at scale.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from swarm.train.bench import best_rate, device_clock, synchronizer

# VmHWM, not ru_maxrss: the latter survives exec, so a child would inherit its parent's high-water mark.
# RssFile is the checkpoint's page cache reached through safetensors' memory map (shared, reclaimable);
# RssAnon is memory the process owns (copies, casts, int8 tensors).
_RSS_CHILD = """
import importlib, json, sys, torch
import transformers.masking_utils
from swarm.train.hf import HFStageModel
from swarm.train.hf.loader import load_hf_config
mt = load_hf_config(sys.argv[1]).model_type
importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
def status():
    rows = (line.split() for line in open("/proc/self/status"))
    return {r[0].rstrip(":"): int(r[1]) * 1024 for r in rows if r[0] in ("VmHWM:", "RssAnon:", "RssFile:")}
before = status()
m = HFStageModel(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), dtype=sys.argv[4], quant=sys.argv[5])
after = status()
growth = {f"{k}_growth_bytes": after[k] - before[k] for k in before}
print(json.dumps({"weight_bytes": m.weight_bytes(), **growth}))
"""


HALF_PRECISION_SLOW = 4.0  # past this slowdown against fp32, a CPU peer is told to compute in fp32


def cpu_half_precision_slowdown(dtype: str, rounds: int = 7) -> float:
    """How many times slower a matmul runs in ``dtype`` than in fp32 on this CPU (1.0 for fp32).

    A CPU without native bf16/fp16 kernels (no AVX512-BF16 or AMX, e.g. AVX2 only) emulates them: a
    (512 x 1536) @ (1536 x 4224) product ran 17x slower in bf16 than in fp32 on an AVX2 EPYC, so a 0.5 B
    Llama's bf16 block took minutes per micro-batch. Measured on a small product on one thread, the two
    dtypes alternating and the fastest of each counted, so a busy machine (a swarm starting beside it)
    slows both alike; about 0.2-0.3 s where bf16 is emulated."""
    from swarm.train.hf.stage import parse_dtype

    half = parse_dtype(dtype)
    if half == torch.float32:
        return 1.0
    pairs = {dt: (torch.randn(64, 512, dtype=dt), torch.randn(512, 512, dtype=dt)) for dt in (torch.float32, half)}
    best = dict.fromkeys(pairs, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(rounds + 1):  # the first round warms up (it is counted too: only the fastest matters)
            for dt, (a, b) in pairs.items():
                t0 = time.perf_counter()
                torch.mm(a, b)
                best[dt] = min(best[dt], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best[half] / max(best[torch.float32], 1e-9)


def cpu_dtype_hint(dtype: str) -> str:
    """One line of advice where ``dtype`` is slow on this CPU, else ""."""
    slowdown = cpu_half_precision_slowdown(dtype)
    if slowdown < HALF_PRECISION_SLOW:
        return ""
    return (
        f"this CPU computes {dtype} {slowdown:.0f}x slower than fp32 (no native {dtype} kernels): "
        "--dtype fp32 trains faster here (with --quant int8 or nf4 the base still takes 1 or 0.56 bytes per weight)"
    )


def hf_layer_throughput(
    path: str | Path,
    device: str,
    *,
    dtype: str,
    quant: str,
    lora_rank: int,
    context: int,
    batch: int,
    activation_checkpointing: bool = False,
) -> float:
    """Forward+backward passes per second of one random layer of the checkpoint at ``path`` on a
    (batch, context) micro-batch, as a middle stage runs it: frozen base, gradients to the adapters and input
    (with ``activation_checkpointing``, the layer's forward runs twice, as in ``HFStageModel``).
    """
    from torch.utils.checkpoint import checkpoint

    from swarm.train.hf.arch import architecture_for
    from swarm.train.hf.loader import CheckpointReader, load_hf_config
    from swarm.train.hf.lora import attach_lora
    from swarm.train.hf.quant import quantize_linears
    from swarm.train.hf.stage import parse_dtype

    dev, compute = torch.device(device), parse_dtype(dtype)
    names = set(CheckpointReader(path).files)  # shard headers only: the tensor names say the layout
    arch = architecture_for(load_hf_config(path), names)
    with torch.device(dev):
        layer = arch.new_layer(0).to(compute)
    layer.requires_grad_(False)
    if quant != "none":
        quantize_linears(layer, quant=quant, dtype=compute, device=dev)
    if lora_rank > 0:
        attach_lora(
            layer,
            targets=arch.lora_targets,
            rank=lora_rank,
            alpha=2.0 * lora_rank,
            name_prefix=arch.layer_tensor_prefix(0),
        )
    rotary = arch.new_rotary(dev)
    received = torch.randn(batch, context, arch.hidden_size, device=dev, requires_grad=True)  # fp32 off the wire
    position_ids = torch.arange(context, device=dev)[None, :]

    def once() -> None:
        h = received.to(compute)
        mask = arch.masks(h, position_ids, [0])[0]
        rope = rotary(h, position_ids) if rotary is not None else None
        args = (layer, h, mask, position_ids, rope)
        if activation_checkpointing:
            out = checkpoint(arch.run_layer, *args, use_reentrant=False)
        else:
            out = arch.run_layer(*args)
        out.float().sum().backward()

    return best_rate(once, sync=synchronizer(dev), clock=device_clock(dev))


def block_memory(path: Path, start: int, end: int, dtype: str, quant: str) -> dict[str, int]:
    """Weight bytes and peak RSS growth of building one block alone, in a fresh interpreter."""
    cmd = [sys.executable, "-c", _RSS_CHILD, str(path), str(start), str(end), dtype, quant]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def logits_errors(path: Path, split: list[tuple[int, int]], *, context: int, batch: int) -> dict[str, float]:
    """Relative L2 error of the chained blocks' logits, per storage/compute mode, against fp32."""
    from swarm.train.hf.stage import HFStageModel

    ids = torch.randint(0, 1000, (batch, context), generator=torch.Generator().manual_seed(0))

    def run(**kwargs) -> torch.Tensor:
        h = ids
        with torch.no_grad():
            for a, b in split:
                h = HFStageModel(path, a, b, **kwargs)(h)
        return h.float()

    ref = run(dtype=torch.float32)
    modes = {
        "bf16": dict(dtype=torch.bfloat16),
        "int8 (bf16 compute)": dict(dtype=torch.bfloat16, quant="int8"),
        "int8 (fp32 compute)": dict(dtype=torch.float32, quant="int8"),
        "nf4 (bf16 compute)": dict(dtype=torch.bfloat16, quant="nf4"),
        "nf4 (fp32 compute)": dict(dtype=torch.float32, quant="nf4"),
    }
    return {name: float((run(**kw) - ref).norm() / ref.norm()) for name, kw in modes.items()}


def activation_bytes(
    path: Path, start: int, end: int, *, quant: str, checkpointing: bool, context: int, batch: int
) -> int:
    """Bytes the autograd graph of one bf16 LoRA micro-batch keeps for the backward (weights excluded).

    Counted with ``saved_tensors_hooks`` over one forward of the block; each storage once. This is what
    every micro-batch in flight costs a stage until its backward, on any device.
    """
    from swarm.train.hf.stage import HFStageModel

    block = HFStageModel(
        path, start, end, dtype="bf16", quant=quant, activation_checkpointing=checkpointing, lora_rank=8
    )
    weights = {t.untyped_storage().data_ptr() for t in block.state_dict(keep_vars=True).values()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    if block.is_first:
        x = torch.randint(0, block.vocab_size, (batch, context), generator=g)
    else:
        x = torch.randn(batch, context, block.d_model, generator=g, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


def make_random_llama(out: Path, *, hidden: int, layers: int, vocab: int = 32000) -> Path:
    """A TinyLlama-shaped random checkpoint in bf16 (no tokenizer needed for these measurements)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out), max_shard_size="200MB")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="memory per block and bf16/int8/nf4 logits error of a HF checkpoint")
    parser.add_argument("path", type=Path)
    parser.add_argument("--split", default="", help="blocks as a:b,b:c (default: two halves)")
    parser.add_argument("--random", choices=["llama"], help="first write a random checkpoint of this shape to PATH")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--skip-errors", action="store_true", help="only measure memory (the error pass runs fp32)")
    args = parser.parse_args(argv)
    if args.random:
        make_random_llama(args.path, hidden=args.hidden, layers=args.layers)
    from swarm.train.hf.loader import load_hf_config

    n = load_hf_config(args.path).num_hidden_layers
    split = [tuple(int(v) for v in part.split(":")) for part in args.split.split(",")] if args.split else []
    split = split or [(0, n // 2), (n // 2, n)]
    report: dict[str, object] = {"blocks": {}}
    if not args.skip_errors:
        report["logits_rel_error_vs_fp32"] = logits_errors(args.path, split, context=args.context, batch=args.batch)
    for a, b in split:
        report["blocks"][f"[{a},{b})"] = {
            mode: block_memory(args.path, a, b, "bf16", "none" if mode == "bf16" else mode)
            for mode in ("bf16", "int8", "nf4")
        }
    report["activation_bytes_per_micro_batch"] = {
        f"[{a},{b})": {
            name: activation_bytes(
                args.path, a, b, quant="nf4", checkpointing=ac, context=args.context, batch=args.batch
            )
            for name, ac in (("nf4", False), ("nf4 + activation checkpointing", True))
        }
        for a, b in split
    }
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in Path(args.path).glob("*.safetensors"))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
