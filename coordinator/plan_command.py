"""``ravn plan``: can these PCs fine-tune this checkpoint, and how fast? No training, no download.

It reads only ``config.json``, describes each PC in one short spec (memory, link, optionally compute and
``nat``), and runs the runtime's own placement (``placement.place``) over the runtime's own cost inputs
(``plan_inputs.hf_model_spec`` on ``memory_model``), so the answer is the plan a real swarm of such peers
would start with. What it cannot know, it assumes and says: a peer's effective compute defaults to
``DEFAULT_TFLOPS`` (a 24 GB gaming GPU), and ``--reserve`` is kept free on every peer for the CUDA
context and allocator slack. Peers described here are exact, so the measurement-noise band is off.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from coordinator import memory_model as mm
from coordinator.cost_model import CostModel, PeerSpec
from coordinator.option_checks import check_choice
from coordinator.placement import NoFit, PlacementError, place
from coordinator.plan_inputs import CODEC_BYTES, hf_model_spec, wire_bytes
from coordinator.reachability import Unarrangeable
from coordinator.wire_choice import choose_links
from coordinator.wire_defaults import default_help, default_wire
from swarm.config import (
    BASE_QUANTS,
    DEFAULT_MAX_STALENESS,
    DEFAULT_MICRO_BATCHES,
    SCHEDULES,
    WIRE_AUTO,
    TrainConfig,
    backward_ladder,
    default_max_in_flight,
    default_schedule,
    forward_ladder,
)

# An RTX 3090 peaks at 71 dense bf16 TFLOP/s and a 4090 at 165; LoRA training with small micro-batches
# reaches roughly 30-50 % of a 3090's peak, so 30 TFLOP/s is a modest, stated guess. Pass NNtflops to override.
DEFAULT_TFLOPS = 30.0
DEFAULT_RESERVE_GIB = 1.0
MEMORY_UNITS = {"gib": 1 << 30, "gb": 1e9, "mib": 1 << 20, "mb": 1e6, "tib": 1 << 40, "tb": 1e12}
LINK_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
_AMOUNT = r"(\d+(?:\.\d+)?)"
ZSTD = TrainConfig().wire_zstd  # no --wire-zstd here: the plan is that of a run with the default (codes coded)


class SpecError(ValueError):
    """A ``--peer`` spec that cannot be read; the message says which part and what is expected."""


@dataclass(frozen=True)
class PeerDescription:
    """One hypothetical PC: bytes of memory, bytes/s each way, effective FLOP/s, accepts connections."""

    memory: float
    upload: float
    download: float
    flops: float = DEFAULT_TFLOPS * 1e12
    reachable: bool = True


def _amount(text: str, units: dict[str, float], what: str, spec: str) -> float:
    m = re.fullmatch(_AMOUNT + r"\s*([a-z]+)", text.strip().lower())
    if not m or m.group(2) not in units:
        raise SpecError(f"peer {spec!r}: {what} {text!r} should look like 24GiB / 100mbit (units: {', '.join(units)})")
    value = float(m.group(1)) * units[m.group(2)]
    if value <= 0:
        raise SpecError(f"peer {spec!r}: {what} must be positive")
    return value


def parse_peer(spec: str) -> PeerDescription:
    """``MEMORY,LINK[,NNtflops][,nat]``; LINK is ``Nmbit`` both ways or ``UP/DOWN`` (e.g. ``40mbit/10mbit``)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) < 2:
        raise SpecError(f"peer {spec!r}: want MEMORY,LINK[,NNtflops][,nat], e.g. 24GiB,100mbit or 24GiB,40mbit/8mbit")
    memory = _amount(parts[0], MEMORY_UNITS, "memory", spec)
    up_text, _, down_text = parts[1].partition("/")
    upload = _amount(up_text, LINK_UNITS, "link", spec)
    download = _amount(down_text, LINK_UNITS, "link", spec) if down_text else upload
    flops, reachable = DEFAULT_TFLOPS * 1e12, True
    for extra in parts[2:]:
        low = extra.lower()
        if low == "nat":
            reachable = False
        elif m := re.fullmatch(_AMOUNT + r"\s*tflops", low):
            flops = float(m.group(1)) * 1e12
            if flops <= 0:
                raise SpecError(f"peer {spec!r}: compute must be positive")
        else:
            raise SpecError(f"peer {spec!r}: unknown part {extra!r} (expected NNtflops or nat)")
    return PeerDescription(memory, upload, download, flops, reachable)


def peer_name(i: int, p: PeerDescription) -> str:
    return f"pc{i}-{p.memory / (1 << 30):g}G" + ("-nat" if not p.reachable else "")


def plan_report(
    arch: mm.Arch,
    settings: mm.Settings,
    peers: list[PeerDescription],
    *,
    wire_forward: str,
    wire_backward: str,
    stages: int = 0,
    reserve: float = DEFAULT_RESERVE_GIB * (1 << 30),
) -> dict:
    """The plan as plain data (what ``--json`` prints); raises ``PlacementError`` with a one-line reason."""
    spec = hf_model_spec(arch, settings, wire_forward, wire_backward, zstd=ZSTD)
    tokens_hidden = float(settings.tokens * arch.hidden)  # values per micro-batch across a boundary
    flops = mm.layer_flops(arch, settings)
    overhead = mm.stage_overhead_bytes(arch, settings)
    names = [peer_name(i, p) for i, p in enumerate(peers)]
    specs = [
        PeerSpec(n, p.flops / flops, max(p.memory - reserve - overhead, 0.0), p.upload, p.download, p.reachable)
        for n, p in zip(names, peers, strict=True)
    ]
    try:
        placement = place(specs, spec, stages=stages, noise=1.0)
    except NoFit:  # placement's message lists every peer; one line about the smallest fit says more here
        n = min(len(peers), stages or len(peers), arch.n_layers)
        why = f"{arch.n_layers} layers over {n} peers do not fit their memory"
        raise NoFit(f"{why}: {smallest_fit(arch, settings, peers[:n], reserve)}") from None
    cm = CostModel(specs, spec)
    by_name = dict(zip(names, peers, strict=True))
    rows = []
    for stage, block in enumerate(placement.blocks):
        a, b = block.layer_start, block.layer_end
        mem = mm.block_memory(arch, settings, a, b)
        for pid in block.peer_ids:
            i = cm.index[pid]
            compute = (cm.cost_cum[b] - cm.cost_cum[a]) * cm.inv_speed[i]
            recv, send = (cm.fwd[a] + cm.bwd[b]) * cm.inv_down[i], (cm.fwd[b] + cm.bwd[a]) * cm.inv_up[i]
            parts = {"compute": compute, "download": recv, "upload": send}
            rows.append(
                {
                    "stage": stage,
                    "peer": pid,
                    "replica": pid != block.peer_ids[0],
                    "layers": [a, b],
                    "base_bytes": mem.base,
                    "adapter_bytes": mem.adapters,
                    "activation_bytes": mem.activations,
                    "ends_bytes": mem.ends,
                    "total_bytes": mem.total,
                    "memory_bytes": by_name[pid].memory,
                    "headroom_bytes": by_name[pid].memory - reserve - mem.total,
                    "seconds_per_micro_batch": float(compute + recv + send),
                    "compute_s": float(compute),
                    "download_s": float(recv),
                    "upload_s": float(send),
                    "limited_by": max(parts, key=parts.get),
                    "stage_seconds": block.time,
                }
            )
    blocks = [(b.layer_start, b.layer_end, list(b.peer_ids)) for b in placement.blocks]
    links = choose_links(
        blocks,
        dict(zip(names, specs, strict=True)),
        spec,
        tokens_hidden,
        wire_forward,
        wire_backward,
        forward_ladder(arch.hidden, zstd=ZSTD),
        backward_ladder(arch.hidden, zstd=ZSTD),
    )
    slow = placement.blocks[placement.bottleneck]
    slow_row = next(r for r in rows if r["peer"] == slow.peer_ids[0])
    tokens = settings.tokens
    return {
        "model": {"type": arch.model_type, "layers": arch.n_layers, "hidden": arch.hidden, "vocab": arch.vocab},
        "settings": {
            **settings.__dict__,
            "lora_targets": list(settings.lora_targets),
            "wire_forward": wire_forward,
            "wire_backward": wire_backward,
            "reserve_bytes": reserve,
        },
        "stages": rows,
        "boundary_bytes_per_token": {  # as planned: under auto, the ladder's smallest codec
            "forward": arch.hidden * wire_bytes(wire_forward, wire_backward, arch.hidden, zstd=ZSTD, tokens=tokens)[0],
            "backward": arch.hidden * wire_bytes(wire_forward, wire_backward, arch.hidden, zstd=ZSTD, tokens=tokens)[1],
        },
        "links": [asdict(x) for x in links],  # each link's codecs (coordinator/wire_choice.py)
        "layer_flops_per_micro_batch": flops,
        "seconds_per_micro_batch": placement.bottleneck_time,
        "tokens_per_second": tokens / placement.bottleneck_time,
        "bottleneck": {"stage": placement.bottleneck, "peer": slow.peer_ids[0], "limited_by": slow_row["limited_by"]},
    }


def smallest_fit(arch: mm.Arch, s: mm.Settings, peers: list[PeerDescription], reserve: float) -> str:
    """What would fit: the memory each of these peers needs, and how many peers of the largest memory."""
    n = min(len(peers), arch.n_layers)
    share = math.ceil(arch.n_layers / n)
    need = mm.min_memory_for(arch, s, share) + reserve
    text = f"needs >= {need / (1 << 30):.1f} GiB per peer for {share} layers each on {n} peers"
    largest = max(p.memory for p in peers)
    count = peers_of(arch, s, largest - reserve)
    if count is None:
        one = mm.min_memory_for(arch, s, 1) + reserve
        return text + f"; a block of one layer with the head needs {one / (1 << 30):.1f} GiB"
    return text + f", or {count} peers of {largest / (1 << 30):g} GiB"


def peers_of(arch: mm.Arch, s: mm.Settings, memory: float) -> int | None:
    """The fewest peers of ``memory`` bytes each that hold the model: the largest first and last blocks
    (embedding; head and logits), the middle filled greedily; None if an end block of one layer is too big."""
    n_layers = arch.n_layers

    def most(fits) -> int:
        return max((k for k in range(1, n_layers + 1) if fits(k)), default=0)

    if mm.block_memory(arch, s, 0, n_layers).total <= memory:
        return 1
    first = most(lambda k: mm.block_memory(arch, s, 0, k).total <= memory)
    last = most(lambda k: mm.block_memory(arch, s, n_layers - k, n_layers).total <= memory)
    middle = most(lambda k: k < n_layers and mm.block_memory(arch, s, 1, 1 + k).total <= memory)
    if not first or not last:
        return None
    rest = n_layers - first - last
    if rest <= 0:
        return 2
    return None if not middle else 2 + math.ceil(rest / middle)


def _gib(x: float) -> str:
    return f"{x / (1 << 30):.2f}"


def render(report: dict, console: Console) -> None:
    """The report as a rich table, then the boundary bytes, the pipeline's rate and its bottleneck."""
    s = report["settings"]
    table = Table(
        title=f"{report['model']['type']} x{report['model']['layers']} layers, {s['dtype']} base, "
        f"quant {s['quant']}, LoRA r{s['lora_rank']}, micro-batch {s['micro_batch_size']}x{s['context']}, "
        f"{s['in_flight']} in flight" + (", checkpointing" if s["activation_checkpointing"] else "")
    )
    for col in (
        "stage",
        "peer",
        "layers",
        "base GiB",
        "LoRA+Adam GiB",
        "activations GiB",
        "emb/head GiB",
        "total GiB",
        "memory GiB",
        "headroom GiB",
        "s / micro-batch",
        "limited by",
    ):
        table.add_column(col, justify="left" if col in ("peer", "limited by") else "right")
    for r in report["stages"]:
        a, b = r["layers"]
        table.add_row(
            str(r["stage"]) + (" (replica)" if r["replica"] else ""),
            r["peer"],
            f"{b - a} [{a},{b})",
            _gib(r["base_bytes"]),
            _gib(r["adapter_bytes"]),
            _gib(r["activation_bytes"]),
            _gib(r["ends_bytes"]),
            _gib(r["total_bytes"]),
            _gib(r["memory_bytes"]),
            _gib(r["headroom_bytes"]),
            f"{r['seconds_per_micro_batch']:.3f}",
            r["limited_by"],
        )
    console.print(table)
    per_token = report["boundary_bytes_per_token"]
    console.print(
        f"boundary bytes per token: forward {per_token['forward']:,.0f} ({s['wire_forward']}), "
        f"backward {per_token['backward']:,.0f} ({s['wire_backward']}); "
        f"{s['reserve_bytes'] / (1 << 30):g} GiB kept free per peer (--reserve)"
    )
    if WIRE_AUTO in (s["wire_forward"], s["wire_backward"]):
        for x in report["links"]:
            console.print(
                f"link {x['upstream']} -> {x['downstream']} (stage {x['boundary']} -> {x['boundary'] + 1}): "
                f"forward {x['forward']} ({x['forward_reason']}), backward {x['backward']} ({x['backward_reason']})"
            )
    bn = report["bottleneck"]
    console.print(
        f"predicted: {report['seconds_per_micro_batch']:.3f} s per micro-batch, "
        f"{report['tokens_per_second']:,.0f} tokens/s; "
        f"bottleneck: stage {bn['stage']} ({bn['peer']}, {bn['limited_by']})"
    )


def plan(
    model: Annotated[Path, typer.Option(help="A checkpoint directory or its config.json (no weights are read).")],
    peer: Annotated[
        list[str],
        typer.Option(
            help="A PC: MEMORY,LINK[,NNtflops][,nat], e.g. 24GiB,100mbit or 12GiB,40mbit/10mbit (UP/DOWN); "
            f"compute defaults to {DEFAULT_TFLOPS:g} TFLOP/s effective (a 24 GB gaming GPU). Repeat per PC."
        ),
    ],
    dtype: Annotated[str, typer.Option(help="Compute dtype of the frozen base: bf16, fp16 or fp32.")] = "bf16",
    quant: Annotated[str, typer.Option(help="Frozen base storage: none, int8 or nf4.")] = "none",
    lora_rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 16,
    micro_batch_size: Annotated[int, typer.Option(min=1, help="Sequences per micro-batch.")] = 4,
    context: Annotated[int, typer.Option(min=0, help="Tokens per sequence (0: min(512, the model's positions)).")] = 0,
    in_flight: Annotated[
        int, typer.Option(min=0, help="Micro-batches in flight (0: the runtime's for --schedule and --micro-batches).")
    ] = 0,
    schedule: Annotated[
        str,
        typer.Option(
            help="The run's schedule, as in ravn local (a checkpoint's default: async with K micro-batches in flight, "
            "as sync keeps).",
            callback=lambda v: check_choice(v, SCHEDULES, "schedule"),
        ),
    ] = default_schedule(from_scratch=False),
    max_staleness: Annotated[
        int, typer.Option(min=0, help="Async: the staleness bound S, as in ravn local.")
    ] = DEFAULT_MAX_STALENESS,
    micro_batches: Annotated[
        int, typer.Option(min=1, help="Micro-batches per step (K), as in ravn local.")
    ] = DEFAULT_MICRO_BATCHES,
    wire_forward: Annotated[
        str | None,
        typer.Option(
            help=f"Wire codec of activations, or auto (chosen per link); {default_help(0)}, as in ravn local.",
            show_default=False,
        ),
    ] = None,
    wire_backward: Annotated[
        str | None,
        typer.Option(
            help=f"Wire codec of gradients, or auto (chosen per link); {default_help(1)}, as in ravn local.",
            show_default=False,
        ),
    ] = None,
    activation_checkpointing: Annotated[bool, typer.Option(help="Keep only layer inputs; recompute.")] = False,
    stages: Annotated[int, typer.Option(min=0, help="Pipeline stages (0: one per peer).")] = 0,
    reserve: Annotated[float, typer.Option(min=0, help="GiB kept free on every peer.")] = DEFAULT_RESERVE_GIB,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Predict the plan, memory per peer and tokens/s of a LoRA fine-tune over the PCs described."""
    try:
        if dtype not in mm.DTYPE_BYTES or quant not in BASE_QUANTS:
            raise SpecError(
                f"--dtype {dtype} --quant {quant}: choose {'/'.join(mm.DTYPE_BYTES)} and {'/'.join(BASE_QUANTS)}"
            )
        for codec in (wire_forward, wire_backward):
            if codec is not None and codec not in (*CODEC_BYTES, "lowrank") and codec != WIRE_AUTO:
                raise SpecError(f"unknown codec {codec!r}; choose {', '.join(CODEC_BYTES)}, lowrank or {WIRE_AUTO}")
        arch = mm.Arch.from_path(model)
        default_forward, default_backward = default_wire(arch.hidden)
        wire_forward, wire_backward = wire_forward or default_forward, wire_backward or default_backward
        ctx = context or min(512, arch.max_positions or 512)
        if arch.max_positions and ctx > arch.max_positions:
            raise SpecError(f"--context {ctx} exceeds the model's {arch.max_positions} positions")
        bound = max_staleness if schedule == "async" else 0
        run = TrainConfig(
            micro_batches=micro_batches,
            micro_batch_size=micro_batch_size,
            schedule=schedule,
            max_staleness=bound,
            max_in_flight=default_max_in_flight(schedule, micro_batches),
        )
        flight = in_flight or run.in_flight_limit
        settings = mm.Settings(
            dtype=dtype,
            quant=quant,
            lora_rank=lora_rank,
            micro_batch_size=micro_batch_size,
            context=ctx,
            in_flight=flight,
            activation_checkpointing=activation_checkpointing,
        )
        peers = [parse_peer(p) for p in peer]
        report = plan_report(
            arch,
            settings,
            peers,
            wire_forward=wire_forward,
            wire_backward=wire_backward,
            stages=stages,
            reserve=reserve * (1 << 30),
        )
    except PlacementError as exc:
        typer.echo(f"ravn plan: no plan fits: {exc}", err=True)
        raise typer.Exit(1) from None
    except Unarrangeable as exc:
        typer.echo(f"ravn plan: blocked on reachability: {exc}", err=True)
        raise typer.Exit(1) from None
    except ValueError as exc:
        typer.echo(f"ravn plan: {exc}", err=True)
        raise typer.Exit(2) from None
    if json_output:
        typer.echo(json.dumps(report, indent=2))
    else:
        render(report, Console(width=200))
