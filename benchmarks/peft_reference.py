"""A reference Ravn did not write: LoRA fine-tuning in one process with transformers + peft, step for step
what a Ravn run with the sync schedule does, so their per-step losses can be compared.

What a Ravn step is (read from the code, not assumed):

* data: the first stage draws micro-batch ``i`` of step ``s`` as
  ``TokenCorpus.batch(split="train", seed=--seed, step=s, index=i, batch_size=--micro-batch-size,
  context=--context)`` (``peer/driver.py``); K = ``--micro-batches`` per step;
* loss: each micro-batch's summed token cross-entropy divided by ``tokens * K`` is back-propagated
  (``StageRunner.forward``), i.e. the mean over micro-batches of each one's mean token loss; the step's
  reported loss is the summed loss over the summed tokens (``Driver._account``);
* optimizer: ``torch.optim.AdamW(betas=(0.9, 0.95), weight_decay=0.01)`` on the adapters; Ravn holds one
  per stage, which is the same thing for an element-wise optimizer; lr ``TrainConfig.lr_at``: linear
  warm-up over 20 steps, then constant; no gradient clipping (Ravn clips each stage's gradient by
  default, which a single process cannot mirror: compare with a Ravn run given ``--grad-clip 0``);
* adapters: Ravn's ``LoRALinear`` initialisation, A Kaiming-uniform from a generator seeded by
  ``(seed, module name)`` and B zero; the same values are written into peft's ``lora_A``/``lora_B``.

    python -m benchmarks.peft_reference CKPT DATA --steps 5 --context 64 --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ADAM_BETAS = (0.9, 0.95)  # StageRunner's
WEIGHT_DECAY = 0.01  # TrainConfig's default; `ravn local` does not change it
WARMUP_STEPS = 20


@dataclass
class Recipe:
    steps: int = 5
    micro_batches: int = 4
    micro_batch_size: int = 4
    context: int = 64
    lr: float = 3e-3
    seed: int = 0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ()
    dtype: str = "fp32"

    def lr_at(self, step: int) -> float:
        return self.lr * min(1.0, (step + 1) / WARMUP_STEPS)


@dataclass
class Result:
    losses: list[float | None] = field(default_factory=list)  # None: a Ravn step with no loss
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / max(sum(self.seconds), 1e-9)

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def ravn_initial_adapters(model: torch.nn.Module, seed: int) -> int:
    """Overwrite peft's initial adapters with Ravn's (``swarm.train.hf.lora.LoRALinear``); returns how many."""
    from peft.tuners.lora import LoraLayer

    from swarm.train.hf.lora import _generator

    n = 0
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        hf_name = name.removeprefix("base_model.model.")  # e.g. model.layers.3.self_attn.q_proj
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        init = torch.empty(a.shape)
        torch.nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=_generator(seed, hf_name))
        with torch.no_grad():
            a.copy_(init)
            b.zero_()
        n += 1
    return n


def build_model(ckpt: str | Path, recipe: Recipe):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from swarm.train.hf.arch import architecture_class
    from swarm.train.hf.loader import load_hf_config
    from swarm.train.hf.stage import parse_dtype

    dtype = parse_dtype(recipe.dtype)
    base = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype, attn_implementation="sdpa")
    targets = list(recipe.lora_targets or architecture_class(load_hf_config(ckpt).model_type).lora_targets)
    config = LoraConfig(
        r=recipe.lora_rank, lora_alpha=recipe.lora_alpha, target_modules=targets, lora_dropout=0.0, bias="none"
    )
    model = get_peft_model(base, config)  # adapters in fp32 over a bf16 base (peft's autocast_adapter_dtype)
    if not ravn_initial_adapters(model, recipe.seed):
        raise RuntimeError("peft attached no LoRA layers")
    return model


def train(ckpt: str | Path, data: str | Path, recipe: Recipe, *, device: str = "cpu", threads: int = 0) -> Result:
    """``threads``: torch compute threads (0: leave torch's default)."""
    from swarm.train.hf import TokenCorpus

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    model = build_model(ckpt, recipe).to(device)
    model.train()
    corpus = TokenCorpus.load(data, ckpt)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=ADAM_BETAS, weight_decay=WEIGHT_DECAY)
    k, out = recipe.micro_batches, Result()
    for step in range(recipe.steps):
        t0 = time.perf_counter()
        loss_sum, tokens = 0.0, 0
        for index in range(k):
            x, y = corpus.batch(
                split="train",
                seed=recipe.seed,
                step=step,
                index=index,
                batch_size=recipe.micro_batch_size,
                context=recipe.context,
            )
            x, y = x.to(device), y.to(device)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=-100, reduction="sum"
            )
            n = int((y != -100).sum())
            (loss / max(n * k, 1)).backward()
            loss_sum += float(loss.detach())
            tokens += n
        for group in opt.param_groups:
            group["lr"] = recipe.lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.seconds.append(time.perf_counter() - t0)
        out.losses.append(loss_sum / max(tokens, 1))
        out.tokens.append(tokens)
    return out


def ravn_steps(run_dir: str | Path) -> Result:
    """Per-step losses, tokens and seconds of a Ravn run, from its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted((r for r in rows if r.get("kind") == "step"), key=lambda r: r["step"])
    return Result(
        losses=[r["loss"] for r in steps], tokens=[r["tokens"] for r in steps], seconds=[r["seconds"] for r in steps]
    )


def compare(ravn: Result, ref: Result) -> dict:
    """Per-step agreement of the two runs. A Ravn step with no loss (every micro-batch dropped: ``null`` in
    metrics.jsonl) has nothing to compare; it is counted, and its tokens already differ."""
    n = min(len(ravn.losses), len(ref.losses))
    pairs = [(a, b) for a, b in zip(ravn.losses[:n], ref.losses[:n], strict=True) if a is not None]
    diffs = [abs(a - b) for a, b in pairs]
    rel = [abs(a - b) / abs(b) for a, b in pairs if b]
    return {
        "steps": n,
        "steps_without_loss": n - len(pairs),
        "max_abs_diff": max(diffs, default=0.0),
        "max_rel_diff": max(rel, default=0.0),
        "last_rel_diff": rel[-1] if rel else 0.0,
        "tokens_equal": ravn.tokens[:n] == ref.tokens[:n],
    }


def side_by_side(ravn: Result, ref: Result) -> str:
    lines = ["| step | Ravn loss | peft loss | abs diff |", "|---|---|---|---|"]
    for i, (a, b) in enumerate(zip(ravn.losses, ref.losses, strict=False)):
        if a is None:
            lines.append(f"| {i} | - | {b:.6f} | - |")
        else:
            lines.append(f"| {i} | {a:.6f} | {b:.6f} | {abs(a - b):.2e} |")
    for name, r in (("Ravn", ravn), ("peft", ref)):
        steady = r.seconds[1:] or r.seconds  # the first step includes warm-up
        lines.append(
            f"\n{name}: {r.tokens_per_s:,.0f} tokens/s, {sum(steady) / max(len(steady), 1):.3f} s/step (after step 0)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("data")
    p.add_argument("--ravn-run", help="a Ravn run directory to compare with (its metrics.jsonl)")
    for f in ("steps", "micro_batches", "micro_batch_size", "context", "seed", "lora_rank"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(Recipe, f))
    p.add_argument("--lr", type=float, default=Recipe.lr)
    p.add_argument("--lora-alpha", type=float, default=Recipe.lora_alpha)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: every core)")
    args = p.parse_args(argv)
    recipe = Recipe(**{k: v for k, v in vars(args).items() if k in Recipe.__dataclass_fields__})
    ref = train(args.checkpoint, args.data, recipe, device=args.device, threads=args.threads)
    if args.ravn_run:
        ravn = ravn_steps(args.ravn_run)
        print(side_by_side(ravn, ref))
        print(json.dumps(compare(ravn, ref)))
    else:
        print(json.dumps(ref.as_dict()))


if __name__ == "__main__":
    main()
