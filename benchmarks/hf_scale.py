"""Memory and speed of LoRA fine-tuning a mid-size Llama over 3 real peer processes, measured, not assumed.

At run time (never committed) it writes a random Llama-architecture checkpoint (bf16, sharded safetensors
with ``model.safetensors.index.json``, a small tokenizer) and a jsonl dataset into a temporary folder,
then for each base storage (bf16, int8, nf4) runs ``ravn local --peers 3 --finetune lora`` and reads what
every peer measured in its own process (``swarm/train/memory.py``, in the run summary's ``stages``):

* load peak: VmHWM growth while building its block, against the block's bytes and the largest tensor
  read (a load must hold no more than its block plus one tensor in flight);
* training peak: VmHWM growth over the run (CUDA: ``max_memory_allocated``), against the memory model;
* tokens/s and seconds per step.

With ``--reference`` it also runs the single-process transformers + peft loop
(``benchmarks/peft_reference.py``) on the same checkpoint, data order and recipe, and compares per-step
losses: with an fp32 base, fp32 wires and the sync schedule they must agree to 1e-4; with the bf16 base
and the default codecs, loss at equal tokens within 2 %.

    python -m benchmarks.hf_scale --params 0.5B --steps 4 --quant none int8 nf4 --out docs/hf_scale
    python -m benchmarks.hf_scale --params 20M --steps 2 --quant none --out /tmp/hf_scale   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SHARD_BYTES = 200 * MiB
WORDS = (
    "the a swarm of peers trains one model together each peer holds a block of layers and sends hidden "
    "states to the next while gradients flow back adapters learn over a frozen base in low rank"
).split()


# ---- the checkpoint -----------------------------------------------------------------------------------


def parse_params(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMB")) * scale)


def llama_shape(params: int, vocab: int) -> dict:
    """Hidden size and layer count of a TinyLlama-shaped model with about ``params`` parameters."""
    sizes = ((60e6, 512), (200e6, 768), (450e6, 1024), (900e6, 1536))
    hidden = next((h for limit, h in sizes if params <= limit), 2048)
    inter = int(hidden * 2.75) // 64 * 64
    kv = max(1, hidden // 256)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv * 64 + 3 * hidden * inter + 2 * hidden
    layers = max(3, round((params - 2 * vocab * hidden) / per_layer))
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv,
        vocab_size=vocab,
    )


def make_checkpoint(out: Path, params: int, *, vocab: int = 16000, seed: int = 0) -> dict:
    """Write a random bf16 Llama of about ``params`` parameters, tensor by tensor (never the whole model in
    memory), as shards of at most 200 MiB with an index, plus a small byte-level BPE tokenizer."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from swarm.train.hf.tiny import make_tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(out)
    special = tok.eos_token_id
    config = LlamaConfig(
        **llama_shape(params, vocab),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=special,
        eos_token_id=special,
        pad_token_id=special,
    )
    config.dtype = "bfloat16"
    config.save_pretrained(str(out))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    weight_map, shard, shard_bytes, files, total = {}, {}, 0, [], 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        if shard_bytes + t.numel() * 2 > SHARD_BYTES:
            flush()
        shard[name] = t
        shard_bytes += t.numel() * 2
        total += t.numel()
    flush()
    # transformers' own names: model-00001-of-0000N.safetensors
    renamed = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (out / old).rename(out / new)
    index = {"metadata": {"total_size": total * 2}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return {"params": total, "bytes": total * 2, "shards": len(files), **llama_shape(params, vocab)}


def make_data(path: Path, *, lines: int = 4000, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text(
        "".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(20, 60)))}) + "\n" for _ in range(lines))
    )
    return path


# ---- the prediction -----------------------------------------------------------------------------------


def predicted_peer_bytes(
    ckpt: Path,
    start: int,
    end: int,
    *,
    dtype: str,
    quant: str,
    lora_rank: int,
    micro_batch_size: int,
    context: int,
    in_flight: int,
) -> dict:
    """The memory model's bytes for a peer holding ``[start, end)``: {"load": weights, "train": total}
    (``coordinator.memory_model.block_memory``, what placement and ``ravn plan`` use)."""
    from coordinator.memory_model import Arch, Settings, block_memory

    s = Settings(
        dtype=dtype,
        quant=quant,
        lora_rank=lora_rank,
        micro_batch_size=micro_batch_size,
        context=context,
        in_flight=in_flight,
    )
    m = block_memory(Arch.from_path(ckpt), s, start, end)
    return {"load": m.base + m.ends, "train": m.total}


def nf4_available() -> str:
    """'' if this branch builds NF4 blocks, else why not (checked on a tiny checkpoint, in a moment)."""
    from swarm.train.hf import HFStageModel
    from swarm.train.hf.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "tiny", "llama")
        try:
            HFStageModel(ckpt, 0, 1, dtype="bf16", quant="nf4")
        except NotImplementedError as e:
            return str(e)
    return ""


# ---- one run ------------------------------------------------------------------------------------------


def ravn_local(
    runs: Path, name: str, ckpt: Path, data: Path, args, *, quant: str, dtype: str, wires: tuple[str, str] | None = None
) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "coordinator.ravn_cli",
        "local",
        "--runs-dir",
        str(runs),
        "--name",
        name,
        "--peers",
        str(args.peers),
        "--model",
        str(ckpt),
        "--finetune",
        "lora",
        "--dtype",
        dtype,
        "--quant",
        quant,
        "--data",
        str(data),
        "--context",
        str(args.context),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--micro-batches",
        str(args.micro_batches),
        "--steps",
        str(args.steps),
        "--lr",
        str(args.lr),
        "--lora-rank",
        str(args.lora_rank),
        "--lora-alpha",
        str(args.lora_alpha),
        "--seed",
        "0",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--schedule",
        "sync",
        "--grad-clip",
        "0",  # the recipe of the peft reference, which does not clip
        "--device",
        args.device,
    ]
    if wires:
        cmd += ["--wire-forward", wires[0], "--wire-backward", wires[1]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    shutil.rmtree(runs / name, ignore_errors=True)  # a fresh run, never a resumed one (--workdir reuse)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=args.timeout)
    run = runs / name
    if proc.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((run / "logs").glob("*.log")))
        raise RuntimeError(
            f"ravn local ({name}) exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
        )
    print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run


def summary(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "summary"][-1]


def layers_of(run: Path) -> dict[str, list[int]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["peer"]: r["layers"] for r in rows if r.get("kind") == "assign"}


def stage_rows(run: Path, ckpt: Path, args, *, quant: str, dtype: str) -> list[dict]:
    s, layers = summary(run), layers_of(run)
    out = []
    for st in s["stages"]:
        a, b = layers.get(st["peer"], [0, 0])
        m = st["memory"]
        cuda = args.device.startswith("cuda")
        pred = (
            predicted_peer_bytes(
                ckpt,
                a,
                b,
                dtype=dtype,
                quant=quant,
                lora_rank=args.lora_rank,
                micro_batch_size=args.micro_batch_size,
                context=args.context,
                in_flight=args.micro_batches,
            )
            if b > a
            else None
        )
        measured_train = m["cuda_train_peak"] if cuda else m["train_peak"]
        measured_load = m["cuda_load_peak"] if cuda else m["load_peak"]
        out.append(
            {
                "stage": st["stage"],
                "layers": [a, b],
                "block_bytes": m["block_bytes"],
                "largest_tensor_bytes": m["largest_tensor_bytes"],
                "load_peak": measured_load,
                "load_over_block": measured_load - m["block_bytes"],
                "train_peak": measured_train,
                "host_load_peak": m["load_peak"],
                "host_train_peak": m["train_peak"],
                "rss_before": m["rss_before"],
                "allocator": m.get("allocator", ""),
                "predicted_load": pred and pred["load"],
                "predicted_train": pred and pred["train"],
                "ratio_train": measured_train / pred["train"] if pred else None,
                "one_tensor_ok": measured_load - m["block_bytes"] <= m["largest_tensor_bytes"] + args.slack_mib * MiB,
            }
        )
    return out


def run_steps(run: Path) -> tuple[list[float], list[int], list[float]]:
    from benchmarks.peft_reference import ravn_steps

    r = ravn_steps(run)
    return r.losses, r.tokens, r.seconds


# ---- the report ---------------------------------------------------------------------------------------


def mib(x) -> str:
    return "n/a" if x is None else f"{x / MiB:,.1f}"


NOTES = """Memory: every number is measured by the peer in its own process (`swarm/train/memory.py`), as growth
over its resident memory just before it built its block; "load − block" is what building held beyond the
block (the check: at most the largest tensor read, plus `--slack-mib` for torch code paged in on first
use); the training peak is VmHWM growth over the run (reset after the build), CUDA peaks on a GPU. The
prediction is `coordinator.memory_model.block_memory(...).total` for the stage's layers and the run's
settings. Losses: the reference is `benchmarks/peft_reference.py` (transformers + peft, one process, the
same data order, loss normalisation, AdamW, warm-up and initial adapters). With fp32 wires a bf16 base
is expected to match exactly too: hidden states cross as fp32, which every bf16 value survives, and a LoRA
delta is added in fp32 and rounded once, as in peft. The default codecs quantise activations and
gradients on the wire, so those losses are compared at equal tokens, within 2 %. Timings on a shared
machine are noisy; the reference runs with a peer's torch threads (cores / peers), since bf16 matmuls round
differently with another thread count."""


def markdown(report: dict) -> str:
    lines = [
        f"# {report['title']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Commit: `{report['commit']}`  ",
        f"Machine: {report['machine']}  ",
        f"Checkpoint: {report['checkpoint']}",
        "",
    ]
    lines += [
        "| base | stage | layers | malloc | block MiB | largest tensor MiB | load peak MiB | load − block MiB | "
        "one tensor in flight | training peak MiB | predicted MiB | measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for quant, res in report["runs"].items():
        if "skipped" in res:
            lines.append(f"| {quant} | skipped: {res['skipped']} ||||||||||")
            continue
        for r in res["stages"]:
            ratio = "n/a" if r["ratio_train"] is None else f"{r['ratio_train']:.2f}"
            lines.append(
                f"| {quant} | {r['stage']} | [{r['layers'][0]},{r['layers'][1]}) | {r['allocator']} | "
                f"{mib(r['block_bytes'])} | "
                f"{mib(r['largest_tensor_bytes'])} | {mib(r['load_peak'])} | {mib(r['load_over_block'])} | "
                f"{'yes' if r['one_tensor_ok'] else 'NO'} | {mib(r['train_peak'])} | {mib(r['predicted_train'])} | "
                f"{ratio} |"
            )
    lines += [
        "",
        "| base | tokens/s | planner's prediction, tokens/s | s/step (after step 0) | losses |",
        "|---|---|---|---|---|",
    ]
    for quant, res in report["runs"].items():
        if "skipped" not in res:
            lines.append(
                f"| {quant} | {res['tokens_per_s']:,.0f} | {res.get('predicted_tokens_per_s', 0.0):,.0f} | "
                f"{res['seconds_per_step']:.2f} | "
                f"{', '.join(f'{x:.4f}' for x in res['losses'])} |"
            )
    for name, cmp in report.get("reference", {}).items():
        c = cmp["compare"]
        key = c["bound_on"]
        verdict = f"{key} = {c[key]:.2e} (bound {c['bound']:g}): {'within' if c['within'] else 'OUTSIDE'}"
        lines += ["", f"## Against transformers + peft: {name}", "", verdict, "", cmp["table"]]
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


def steady(seconds: list[float]) -> float:
    s = seconds[1:] or seconds
    return sum(s) / max(len(s), 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", default="0.5B", help="parameters of the random checkpoint (e.g. 20M, 0.5B)")
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quant", nargs="+", default=["none", "int8", "nf4"], choices=["none", "int8", "nf4"])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--device", default="cpu", help="--device of every peer (cpu here; cuda on a GPU)")
    p.add_argument("--reference", action="store_true", help="also run the transformers + peft loop and compare")
    p.add_argument(
        "--reference-threads",
        type=int,
        default=0,
        help="torch threads of the reference (0: a peer's, cores / peers as ravn local gives them; bf16 matmuls "
        "round differently with another thread count: 7.6e-4 on the first step's loss at 0.5 B)",
    )
    p.add_argument("--slack-mib", type=float, default=16.0, help="code pages etc. allowed beyond one tensor")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--workdir", help="keep the checkpoint and runs here (default: a temporary folder)")
    p.add_argument("--out", help="write OUT.json and OUT.md (e.g. docs/hf_scale)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    with tempfile.TemporaryDirectory(prefix="hf_scale_") as tmp:
        work = Path(args.workdir or tmp)
        ckpt, data, runs = work / "ckpt", work / "data.jsonl", work / "runs"
        t0 = time.perf_counter()
        if not (ckpt / "model.safetensors.index.json").exists():
            info = make_checkpoint(ckpt, parse_params(args.params), vocab=args.vocab)
        else:
            config = json.loads((ckpt / "config.json").read_text())
            index = json.loads((ckpt / "model.safetensors.index.json").read_text())
            nbytes = index["metadata"]["total_size"]
            keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            info = {"params": nbytes // 2, "bytes": nbytes, "shards": len(set(index["weight_map"].values()))}
            info |= {k: config[k] for k in (*keys, "num_key_value_heads", "vocab_size")}
        make_data(data)
        print(
            f"checkpoint: {info['params'] / 1e6:,.0f} M parameters, {info['bytes'] / MiB:,.0f} MiB bf16 "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        report = {
            "title": f"LoRA over {args.peers} peer processes, random Llama of {info['params'] / 1e6:,.0f} M parameters",
            "command": "python -m benchmarks.hf_scale " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": _commit(),
            "machine": _machine(args.device),
            "checkpoint": info,
            "runs": {},
            "args": vars(args),
        }
        nf4_missing = nf4_available() if "nf4" in args.quant else ""
        for quant in args.quant:
            if quant == "nf4" and nf4_missing:
                print(f"  nf4 skipped: {nf4_missing}", flush=True)
                report["runs"][quant] = {"skipped": f"HFStageModel: {nf4_missing}"}
                continue
            run = ravn_local(runs, f"q-{quant}", ckpt, data, args, quant=quant, dtype=args.dtype)
            losses, tokens, seconds = run_steps(run)
            s = summary(run)
            report["runs"][quant] = {
                "stages": stage_rows(run, ckpt, args, quant=quant, dtype=args.dtype),
                "losses": losses,
                "tokens_per_s": s["tokens_per_s"],
                "predicted_tokens_per_s": s.get("predicted_tokens_per_s", 0.0),  # the planner's, for the plan
                "seconds_per_step": steady(seconds),
                "tokens": tokens,
            }
        if args.reference:
            report["reference"] = reference(runs, ckpt, data, args)
        text = markdown(report)
        print(text)
        if args.out:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(report, indent=1))
            out.with_suffix(".md").write_text(text)


def reference(runs: Path, ckpt: Path, data: Path, args) -> dict:
    """Ravn against transformers + peft: fp32 base + fp32 wires (exact), and bf16 + default codecs (2 %)."""
    from benchmarks.peft_reference import Recipe, compare, ravn_steps, side_by_side, train

    out = {}
    cases = (  # (name, base dtype, wires or None for the defaults, bound, on what)
        ("fp32 base, fp32 wires, sync", "fp32", ("fp32", "fp32"), 1e-4, "max_abs_diff"),
        (f"{args.dtype} base, fp32 wires, sync", args.dtype, ("fp32", "fp32"), 1e-4, "max_abs_diff"),
        (f"{args.dtype} base, default codecs, sync", args.dtype, None, 0.02, "max_rel_diff"),
    )
    for name, dtype, wires, bound, key in cases:
        tag = f"ref-{dtype}-{'fp32wires' if wires else 'default'}"
        run = ravn_local(runs, tag, ckpt, data, args, quant="none", dtype=dtype, wires=wires)
        recipe = Recipe(
            steps=args.steps,
            micro_batches=args.micro_batches,
            micro_batch_size=args.micro_batch_size,
            context=args.context,
            lr=args.lr,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            dtype=dtype,
        )
        threads = args.reference_threads or max(1, (os.cpu_count() or 1) // args.peers)
        ref = train(ckpt, data, recipe, device=args.device, threads=threads)
        ravn = ravn_steps(run)
        result = compare(ravn, ref)
        result.update(bound=bound, bound_on=key, within=result[key] <= bound)
        out[name] = {
            "compare": result,
            "table": side_by_side(ravn, ref),
            "ravn": ravn.as_dict(),
            "peft": ref.as_dict(),
        }
        print(out[name]["table"], "\n", json.dumps(out[name]["compare"]), flush=True)
    return out


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("RAVN_COMMIT", "unknown")  # a copy of the tree without .git (a lent GPU machine)


def _machine(device: str) -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    text = f"{os.cpu_count()} CPU cores, {mem:.0f} GiB RAM, torch {torch.__version__}"
    if device.startswith("cuda") and torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return text


if __name__ == "__main__":
    main()
