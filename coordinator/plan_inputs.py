"""Turn what peers announced and what the run trains into the planner's inputs.

The planner (``coordinator/planner.py``) works in abstract units; this is where Ravn's real numbers are
mapped onto them: a peer's measured layer throughput (forward+backward of one layer on one
micro-batch), its memory and its link, and per layer the compute, memory and the bytes each boundary
carries per micro-batch after the wire codecs.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.cost_model import CostModel, InfeasiblePlanError, ModelSpec, PeerSpec
from coordinator.planner import Plan, evaluate_plan
from swarm.config import HFConfig, ModelConfig, TrainConfig
from swarm.dht_schema import PeerRecord

# bytes per element on the wire, counting the fp16 scale of each 64-element block
CODEC_BYTES = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "int8": 1 + 2 / 64,
    "int4": 0.5 + 2 / 64,
    "int4_rot": 0.5 + 2 / 64,
}
ACTIVATION_TENSORS_PER_LAYER = 16  # saved tensors of one pre-norm block per token and channel, roughly
MIN_SPEED = 1e-3
MIN_BANDWIDTH = 1e3


SAME_SPEED = 0.25  # speeds this close to the median count as equal: a short self-benchmark is noisy


def _steady(speeds: list[float]) -> list[float]:
    """Speeds within ±25% of the median become the median, so identical peers get identical blocks.

    Peers measure themselves for half a second, often all at once on a shared machine; 2-3x spreads between
    identical peers were seen, which made the planner split 6 layers 4/1/1 among equals.
    """
    if not speeds:
        return speeds
    ordered = sorted(speeds)
    median = ordered[len(ordered) // 2]
    return [median if abs(v - median) <= SAME_SPEED * median else v for v in speeds]


def peer_specs(records: Sequence[PeerRecord]) -> list[PeerSpec]:
    """Measured claims as planner input; a peer that measured nothing still gets a tiny positive rate."""
    speeds = _steady([max(r.throughput_layers_per_s, MIN_SPEED) for r in records])
    return [
        PeerSpec(
            peer_id=r.peer_id,
            speed=speed,
            free_memory=float(r.free_memory_bytes),
            upload=max(r.bandwidth_up_bytes_per_s, MIN_BANDWIDTH),
            download=max(r.bandwidth_down_bytes_per_s, MIN_BANDWIDTH),
        )
        for r, speed in zip(records, speeds, strict=True)
    ]


def model_spec(model: ModelConfig, train: TrainConfig, hf: HFConfig | None = None) -> ModelSpec:
    """Identical layers: compute 1 unit each; memory for weights, optimizer and activations in flight."""
    d, tokens = model.d_model, train.micro_batch_size * model.context
    params = 12 * d * d  # attention (4 d^2) + MLP (8 d^2) per layer
    if hf is None:
        weights = params * (4 + 4 + 8)  # fp32 weights, gradients, AdamW moments
    else:
        weights = params * (1 if hf.int8 else 4 if hf.dtype == "fp32" else 2)  # frozen base; adapters are tiny
    activations = tokens * d * ACTIVATION_TENSORS_PER_LAYER * 4 * train.in_flight_limit
    return ModelSpec.uniform(
        model.n_layers,
        layer_memory=float(weights + activations),
        boundary_bytes=tokens * d * CODEC_BYTES[train.wire_forward],
        backward_bytes=tokens * d * CODEC_BYTES[train.wire_backward],
    )


def plan_every_peer(peers: Sequence[PeerSpec], model: ModelSpec) -> Plan:
    """One block per peer, sized to minimise the slowest stage; every peer gets a block.

    Without replicas a peer left out of the plan would only wait, so while the runtime cannot use
    replicas every peer holds a block: the best contiguous split for a given peer order is an exact
    O(P·L²) dynamic programme, tried for the peers fastest-first and by id (it also absorbs noisy
    speed measurements: a peer that measured slow gets a small block instead of none).
    """
    n_layers = model.n_layers
    if not peers:
        raise InfeasiblePlanError("no peers")
    if len(peers) > n_layers:
        raise InfeasiblePlanError(f"{len(peers)} peers for {n_layers} layers: at most one peer per layer")
    cm = CostModel(peers, model)
    best: Plan | None = None
    orders = [sorted(peers, key=lambda p: -p.speed), sorted(peers, key=lambda p: p.peer_id)]
    for order in orders:
        idx = [cm.index[p.peer_id] for p in order]
        n = len(order)
        inf = float("inf")
        cost = [[inf] * (n_layers + 1) for _ in range(n + 1)]  # cost[k][e]: first k peers hold [0, e)
        cut = [[0] * (n_layers + 1) for _ in range(n + 1)]
        cost[0][0] = 0.0
        for k in range(1, n + 1):
            for e in range(k, n_layers - (n - k) + 1):
                for s in range(k - 1, e):
                    if cost[k - 1][s] == inf:
                        continue
                    t = max(cost[k - 1][s], cm.stage_time([idx[k - 1]], s, e))
                    if t < cost[k][e]:
                        cost[k][e], cut[k][e] = t, s
        if cost[n][n_layers] == inf:
            continue
        bounds, e = [], n_layers
        for k in range(n, 0, -1):
            s = cut[k][e]
            bounds.append((s, e, [order[k - 1].peer_id]))
            e = s
        candidate = evaluate_plan(list(reversed(bounds)), peers, model)
        if best is None or candidate.bottleneck_time < best.bottleneck_time:
            best = candidate
    if best is None:
        raise InfeasiblePlanError("no split gives every peer a block it can hold in memory")
    return best
