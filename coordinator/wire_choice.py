"""Which codec each link of a plan sends with: the rule behind ``--wire-forward auto`` / ``--wire-backward auto``.

Pure functions of the placement (blocks and their holders), the peers' measured links (``PeerSpec``) and the
planned cost model; no I/O. A link is one (upstream holder, downstream holder) pair across the boundary
between stage ``i`` and ``i + 1``. The rule, per direction:

* The **ladder** is ordered least lossy first (``swarm.config.forward_ladder`` and ``backward_ladder``:
  bf16, int8, int4_rot, then int3_rot when the run codes 3- and 4-bit payloads with zstd), least
  per-message error first; plain int4, whose loss cost at 300 steps exceeded 2% before gradients got fp32
  scales, is not on them (docs/codecs.md). On a model narrower than ``WIDE_FROM`` the activations' ladder
  ends at int8 and the gradients' at int4_rot: 4-bit activations cost more than 2% there, and int3_rot was
  not measured there.
* The **budget** of a boundary is the pipeline's bottleneck time per micro-batch without that boundary's
  transfers: the slowest stage of the cost model with the boundary's bytes set to zero (the other
  boundaries carry what the planner sized them with). A link that sends one micro-batch within it does
  not become the bottleneck.
* The link's **bandwidth** is the sender's measured upload and the receiver's download, the smaller.
* The pick is the first codec on the ladder whose transfer of one micro-batch's tensor (elements x bytes
  per element of the codec / bandwidth) fits the budget; if none does, the smallest (the link is the
  bottleneck whatever it sends). Sizes are plain, before zstd: int3_rot is priced as int4_rot (what it
  codes to depends on the data), so it is picked only where nothing fits, where it sends the fewest bytes.

Activations are encoded before the sender routes them to one of the next block's holders, so a sender
uses one forward codec for all its downstream links: the pick over the slowest of them. Gradients are
encoded for the holder they go back to, so each link has its own backward codec. Explicit codecs (not
``auto``) are put on every link unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from coordinator.cost_model import CostModel, ModelSpec, PeerSpec
from coordinator.plan_inputs import CODEC_BYTES, GRADIENT_CODEC_BYTES
from swarm.config import AUTO_BACKWARD_LADDER, AUTO_FORWARD_LADDER, WIRE_AUTO

__all__ = ["FITS", "LINK_BOUND", "LinkChoice", "bottleneck_without", "choose_links", "pick_codec"]

FITS = "fits the bottleneck"
LINK_BOUND = "smallest: link-bound"


@dataclass(frozen=True)
class LinkChoice:
    """The codecs of one link, the measured Mbit/s each was chosen from, and why."""

    boundary: int  # between stage ``boundary`` and ``boundary + 1``
    upstream: str
    downstream: str
    forward: str
    backward: str
    forward_mbit_s: float
    backward_mbit_s: float
    forward_reason: str
    backward_reason: str


def pick_codec(
    ladder: Sequence[str], elements: float, bandwidth: float, budget: float, sizes: Mapping[str, float] = CODEC_BYTES
) -> tuple[str, str]:
    """(codec, reason): the first of ``ladder`` whose ``elements`` cross ``bandwidth`` (bytes/s) within
    ``budget`` seconds, else the ladder's last (smallest) codec; ``sizes``: bytes per element by codec."""
    if not ladder:
        raise ValueError("an empty codec ladder")
    if not bandwidth > 0:
        raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    for codec in ladder:
        if elements * sizes[codec] / bandwidth <= budget:
            return codec, FITS
    return ladder[-1], LINK_BOUND


def bottleneck_without(cm: CostModel, stages: Sequence[tuple[int, int, Sequence[str]]], boundary: int) -> float:
    """Seconds per micro-batch of the slowest stage when boundary ``boundary`` (between stage ``boundary``
    and ``boundary + 1``) carries nothing: what a link there may take without slowing the pipeline."""
    cut = stages[boundary][1]  # the layer index of the boundary
    spec = cm.model
    fwd, bwd = list(spec.forward_bytes), list(spec.backward_bytes)
    fwd[cut - 1] = bwd[cut - 1] = 0.0
    free = CostModel(cm.peers, replace(spec, forward_bytes=tuple(fwd), backward_bytes=tuple(bwd)))
    return max(free.stage_time([free.index[p] for p in peers], a, b) for a, b, peers in stages)


def _mbit(bytes_per_s: float) -> float:
    return round(bytes_per_s * 8 / 1e6, 3)


def choose_links(
    stages: Sequence[tuple[int, int, Sequence[str]]],
    peers: Mapping[str, PeerSpec],
    model: ModelSpec,
    elements: float,
    forward: str,
    backward: str,
    forward_codecs: tuple[str, ...] = AUTO_FORWARD_LADDER,
    backward_codecs: tuple[str, ...] = AUTO_BACKWARD_LADDER,
) -> list[LinkChoice]:
    """Every link of ``stages`` (``(layer_start, layer_end, holders)`` in pipeline order) with its codecs.

    ``peers``: each holder's measured link; ``model``: the cost model as planned; ``elements``: values per
    micro-batch across a boundary (tokens x width); ``forward``/``backward``: a codec, or ``auto``.
    """
    if any(not holders for _, _, holders in stages):
        return []  # a placeholder plan (nobody holds a block yet): no links
    missing = sorted({p for _, _, holders in stages for p in holders} - set(peers))
    if missing:
        raise ValueError(f"no link measurement for planned peer(s) {', '.join(missing)}")
    cm = CostModel(list(peers.values()), model)
    links: list[LinkChoice] = []
    for i in range(len(stages) - 1):
        ups, downs = stages[i][2], stages[i + 1][2]
        auto = WIRE_AUTO in (forward, backward)
        budget = bottleneck_without(cm, stages, i) if auto else math.inf
        for s in ups:
            sender = peers[s]
            fwd_bw = min(min(sender.upload, peers[r].download) for r in downs)  # one codec for every holder
            if forward == WIRE_AUTO:
                fwd, fwd_why = pick_codec(forward_codecs, elements, fwd_bw, budget)
            else:
                fwd, fwd_why = forward, "set by --wire-forward"
            for r in downs:
                bwd_bw = min(peers[r].upload, sender.download)
                if backward == WIRE_AUTO:
                    bwd, bwd_why = pick_codec(backward_codecs, elements, bwd_bw, budget, GRADIENT_CODEC_BYTES)
                else:
                    bwd, bwd_why = backward, "set by --wire-backward"
                links.append(LinkChoice(i, s, r, fwd, bwd, _mbit(fwd_bw), _mbit(bwd_bw), fwd_why, bwd_why))
    return links
