"""The prepared GPU check (issue #18 c): one short script, run once on a machine with a CUDA device.

1. The wire codecs encode a CUDA tensor (quantised on the GPU, then copied to host bytes) and decode onto
   the GPU: time per call and round-trip error, for activation- and gradient-sized tensors.
2. A random Llama checkpoint generated at run time (``benchmarks/hf_scale.py``), fine-tuned with LoRA by
   3 peer processes sharing the GPU (``ravn local --device cuda``) with a bf16 and an NF4 base: tokens/s,
   seconds per step, and each peer's CUDA peak memory (``torch.cuda.max_memory_allocated`` growth over
   its footprint before building its block, measured in the peer) against its block's bytes and the
   memory model's prediction.

Writes ``docs/gpu_check.md`` (and ``.json``). On a GPU (about 5 minutes on an H200 at 0.5 B):

    python -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --device cpu --params 20M --steps 2 --out /tmp/gpu_check   # a CPU smoke test
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

import torch

from benchmarks import hf_scale
from swarm.wire import codecs

MiB = 1 << 20
CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "int4_rot", "int3_rot")


def codec_rows(device: str, repeats: int) -> list[dict]:
    """Encode a tensor that lives on ``device`` and decode onto ``device``, as a peer's wire policy does."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (8, 1024, 2048)  # 64 MiB of fp32, the size #19's codec target is stated at
    tensors = {
        "activations 8x1024x2048": torch.randn(shape, device=dev, generator=g),
        "gradients 8x1024x2048": torch.randn(shape, device=dev, generator=g) * 1e-3,
    }
    rows = []
    for what, x in tensors.items():
        for codec in CODECS:
            enc = codecs.encode(x, codec)  # warm-up (kernels, rotation matrices)
            codecs.decode(enc, device=dev)
            enc_s, dec_s = [], []
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                enc = codecs.encode(x, codec)
                sync()
                t1 = time.perf_counter()
                y = codecs.decode(enc, device=dev)
                sync()
                enc_s.append(t1 - t0)
                dec_s.append(time.perf_counter() - t1)
            err = float((y.float() - x).norm() / x.norm())
            rows.append(
                {
                    "tensor": what,
                    "codec": codec,
                    "bytes": enc.nbytes,
                    "encode_ms": 1e3 * min(enc_s),
                    "decode_ms": 1e3 * min(dec_s),
                    "gb_per_s": x.numel() * 4 / (min(enc_s) + min(dec_s)) / 1e9,
                    "rel_error": err,
                    "decoded_on": str(y.device),
                }
            )
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# GPU check: codecs on the device, 3 peers on one GPU, bf16 and NF4 with LoRA",
        "",
        f"Command: `{report['command']}`  ",
        f"Commit: `{report['commit']}`  ",
        f"Machine: {report['machine']}  ",
        f"Checkpoint: {report.get('checkpoint', 'not made yet')}",
        "",
        "## Codecs (encode a tensor on the device to bytes, decode onto the device)",
        "",
        "| tensor | codec | bytes | encode ms | decode ms | GB/s fp32 in | rel. error | decoded on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["codecs"]:
        lines.append(
            f"| {r['tensor']} | {r['codec']} | {r['bytes']:,} | {r['encode_ms']:.2f} | {r['decode_ms']:.2f} | "
            f"{r['gb_per_s']:.2f} | "
            f"{r['rel_error']:.2e} | {r['decoded_on']} |"
        )
    lines += [
        "",
        "## LoRA fine-tuning, 3 peer processes",
        "",
        "| base | stage | layers | block MiB | load peak MiB | training peak MiB | predicted MiB | measured / pred. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for quant, res in report["runs"].items():
        if "skipped" in res or "error" in res:
            lines.append(f"| {quant} | {res.get('skipped') or res.get('error')} |||||||")
            continue
        for r in res["stages"]:
            ratio = "n/a" if r["ratio_train"] is None else f"{r['ratio_train']:.2f}"
            lines.append(
                f"| {quant} | {r['stage']} | [{r['layers'][0]},{r['layers'][1]}) | {hf_scale.mib(r['block_bytes'])} | "
                f"{hf_scale.mib(r['load_peak'])} | {hf_scale.mib(r['train_peak'])} | "
                f"{hf_scale.mib(r['predicted_train'])} | {ratio} |"
            )
    lines += ["", "| base | tokens/s | planner's tokens/s | s/step (after step 0) |", "|---|---|---|---|"]
    for quant, res in report["runs"].items():
        if "stages" in res:
            pred = res.get("predicted_tokens_per_s")
            pred = "n/a" if pred is None else f"{pred:,.0f}"
            lines.append(f"| {quant} | {res['tokens_per_s']:,.0f} | {pred} | {res['seconds_per_step']:.3f} |")
    peaks = "CUDA" if report["args"]["device"].startswith("cuda") else "host (VmHWM; --device cpu smoke test)"
    lines += ["", f"Peaks are {peaks} growth over each peer's footprint before it built its block."]
    return "\n".join(lines) + "\n"


def save(report: dict, out: Path) -> str:
    """Write what is measured so far: a device lease can end mid-run, and the finished parts must come back."""
    text = markdown(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--params", default="0.5B")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quant", nargs="+", default=["none", "nf4"], choices=["none", "int8", "nf4"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="the base's dtype")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10, help="timings per codec (the best is kept)")
    p.add_argument("--timeout", type=float, default=420, help="seconds per ravn local run")
    p.add_argument("--out", default="docs/gpu_check")
    p.add_argument("--work", help="keep the checkpoint and the runs' logs here (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here; pass --device cpu for a smoke test")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run_args = argparse.Namespace(
        peers=3,
        context=args.context,
        micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches,
        steps=args.steps,
        lr=1e-3,
        lora_rank=8,
        lora_alpha=16.0,
        device=args.device,
        timeout=args.timeout,
        slack_mib=16.0,
    )
    report = {
        "command": "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": hf_scale._commit(),
        "machine": hf_scale._machine(args.device),
        "args": vars(args),
        "runs": {},
    }
    report["codecs"] = codec_rows(args.device, args.repeats)
    save(report, Path(args.out))
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(args.work or tmp)
        report["checkpoint"] = hf_scale.make_checkpoint(
            work / "ckpt", hf_scale.parse_params(args.params), vocab=args.vocab
        )
        data = hf_scale.make_data(work / "data.jsonl")
        nf4_missing = hf_scale.nf4_available() if "nf4" in args.quant else ""
        for quant in args.quant:
            if quant == "nf4" and nf4_missing:
                report["runs"][quant] = {"skipped": f"HFStageModel: {nf4_missing}"}
                continue
            try:  # one failed base must not lose the other's numbers
                run = hf_scale.ravn_local(
                    work / "runs", f"q-{quant}", work / "ckpt", data, run_args, quant=quant, dtype=args.dtype
                )
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                report["runs"][quant] = {"error": str(e).splitlines()[0][:200]}
                print(e, file=sys.stderr)
                continue
            _, _, seconds = hf_scale.run_steps(run)
            s = hf_scale.summary(run)
            report["runs"][quant] = {
                "stages": hf_scale.stage_rows(run, work / "ckpt", run_args, quant=quant, dtype=args.dtype),
                "tokens_per_s": s["tokens_per_s"],
                "predicted_tokens_per_s": s.get("predicted_tokens_per_s"),
                "seconds_per_step": hf_scale.steady(seconds),
            }
            save(report, Path(args.out))
    print(save(report, Path(args.out)))


if __name__ == "__main__":
    main()
