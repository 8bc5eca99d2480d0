"""The PyTorch baseline: one ``torch.distributed.pipelining`` stage per process, gloo over the lab links.

``vs_torch_pipelining.py`` starts ``store`` in the coordinator's namespace and one ``worker`` per peer
namespace. Every worker builds its block with ``swarm.train.model.StageModel`` (so the weights are the
ones Ravn starts from), reads the same micro-batches from ``swarm.train.data.Corpus`` and applies Ravn's
recipe (AdamW, betas (0.9, 0.95), warm-up then constant learning rate), so the only differences to a
Ravn sync fp32 run are the schedule implementation and the transport.

    python -m benchmarks.torch_pipe store --host 10.77.0.2 --port 29500 --world 3
    python -m benchmarks.torch_pipe worker --rank 0 --world 3 --store 10.77.0.2:29500 --out DIR ...

With ``--wire bf16`` every stage casts what it sends to bfloat16 at its boundary (activations
forward; autograd then sends the gradients back as bfloat16 too) and the receiver casts them back
to float32: the stronger baseline, half of fp32's bytes, the same rounding as Ravn's ``bf16`` codec.

Stage metadata is given statically (``input_args``/``output_args``), so pipelining never falls back
to its pickled object exchange. Each worker writes ``DIR/rank<r>.json``: absolute ``time.time()``
stamps (one clock for all namespaces on this machine) of the start, of every step's end, and of
every validation pass, plus the losses on the last rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from swarm.config import DEFAULT_GRAD_CLIP, DEFAULT_LR, MODEL_PRESETS, TrainConfig
from swarm.train.data import Corpus
from swarm.train.model import StageModel, even_split

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class BoundaryCast(torch.nn.Module):
    """A stage whose hidden states cross the wire as ``dtype``: cast on the way out, back on the way in."""

    def __init__(self, model: StageModel, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.model.is_first:
            x = x.float()
        out = self.model(x)
        return out if self.model.is_last else out.to(self.dtype)


def serve_store(host: str, port: int, world: int, timeout_s: float) -> None:
    """Hold the rendezvous store until every rank has said it is done (or the timeout passes)."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    print(f"READY {port}", flush=True)
    store.wait([f"done/{r}" for r in range(world)], timedelta(seconds=timeout_s))
    time.sleep(1.0)  # let the ranks' process groups shut down before the store goes away


def _batch(corpus: Corpus, split: str, step: int, count: int, train: TrainConfig, context: int):
    """``count`` micro-batches of one step side by side: the schedule cuts them apart again in order."""
    parts = [
        corpus.batch(
            split=split, seed=train.data_seed, step=step, index=i, batch_size=train.micro_batch_size, context=context
        )
        for i in range(count)
    ]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss of a micro-batch; with ``scale_grads`` the step's gradient is Ravn's sum / tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=args.timeout))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    cfg = MODEL_PRESETS[args.model]
    train = TrainConfig(
        steps=args.steps,
        micro_batches=args.micro_batches,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        grad_clip=args.grad_clip,
        data_seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.micro_batches,
    )
    start, end = even_split(cfg.n_layers, args.world)[args.rank]
    model = StageModel(cfg, start, end)
    b, t = args.micro_batch_size, cfg.context
    wire = WIRE_DTYPES[args.wire]
    # hidden states must require grad in the static metadata, or the stage neither expects nor sends gradients
    example_in = (
        torch.zeros(b, t, dtype=torch.long)
        if model.is_first
        else torch.zeros(b, t, cfg.d_model, dtype=wire, requires_grad=True)
    )
    example_out = (
        torch.zeros(b, t, cfg.vocab_size, requires_grad=True)
        if model.is_last
        else torch.zeros(b, t, cfg.d_model, dtype=wire, requires_grad=True)
    )
    stage_module = model if args.wire == "fp32" else BoundaryCast(model, wire)
    stage = PipelineStage(
        stage_module, args.rank, args.world, torch.device("cpu"), input_args=example_in, output_args=example_out
    )
    schedule = SCHEDULES[args.schedule](stage, args.micro_batches, loss_fn=_loss, scale_grads=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(0.9, 0.95), weight_decay=train.weight_decay)
    corpus = Corpus.load(train.data) if (model.is_first or model.is_last) else None
    k = args.micro_batches
    record: dict = {"rank": args.rank, "schedule": args.schedule, "wire": args.wire, "steps": [], "evals": []}

    def run_step(step: int, split: str) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        x, y = _batch(corpus, split, step, k, train, t) if corpus is not None else (None, None)
        inputs = (x,) if model.is_first else ()
        target = y if model.is_last else None
        if split == "train":
            schedule.step(*inputs, target=target, losses=losses if model.is_last else None)
        else:
            with torch.no_grad():
                schedule.eval(*inputs, target=target, losses=losses if model.is_last else None)
        return losses

    def evaluate(step: int) -> None:
        model.eval()
        losses = run_step(0, "val")
        model.train()
        if model.is_last:
            record["evals"].append({"step": step, "time": time.time(), "loss": float(torch.stack(losses).mean())})

    dist.barrier()
    record["t0"] = time.time()
    for step in range(args.steps):
        if step and train.eval_every and step % train.eval_every == 0:
            evaluate(step - 1)  # like Ravn: validation of step s runs before step s + 1 starts
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step)
        losses = run_step(step, "train")
        if train.grad_clip > 0:  # per stage, as Ravn clips: the same recipe on both sides
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        entry = {"step": step, "time": time.time()}
        if model.is_last:
            entry["loss"] = float(torch.stack(losses).detach().mean())
        record["steps"].append(entry)
    evaluate(args.steps - 1)
    dist.barrier()
    Path(args.out, f"rank{args.rank}.json").write_text(json.dumps(record))
    store.set(f"done/{args.rank}", "1")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("store", help="rendezvous store (run in the coordinator's namespace)")
    st.add_argument("--host", required=True)
    st.add_argument("--port", type=int, required=True)
    st.add_argument("--world", type=int, required=True)
    st.add_argument("--timeout", type=float, default=3600)
    wk = sub.add_parser("worker", help="one pipeline stage (run in a peer's namespace)")
    wk.add_argument("--rank", type=int, required=True)
    wk.add_argument("--world", type=int, required=True)
    wk.add_argument("--store", required=True, help="HOST:PORT of the rendezvous store")
    wk.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    wk.add_argument("--wire", choices=sorted(WIRE_DTYPES), default="fp32", help="dtype of hidden states on the wire")
    wk.add_argument("--model", default="gpt-medium", choices=sorted(MODEL_PRESETS))
    wk.add_argument("--steps", type=int, required=True)
    wk.add_argument("--micro-batches", type=int, default=8)
    wk.add_argument("--micro-batch-size", type=int, default=4)
    wk.add_argument("--eval-every", type=int, default=0)
    wk.add_argument("--lr", type=float, default=DEFAULT_LR)
    wk.add_argument("--grad-clip", type=float, default=DEFAULT_GRAD_CLIP, help="per stage, as Ravn clips (0: off)")
    wk.add_argument("--seed", type=int, default=0)
    wk.add_argument("--threads", type=int, default=1)
    wk.add_argument("--timeout", type=float, default=600)
    wk.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "store":
        serve_store(args.host, args.port, args.world, args.timeout)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        run_worker(args)


if __name__ == "__main__":
    main()
