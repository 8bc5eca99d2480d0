"""The plan of a run: who holds which block, how a new plan is made, and each peer's Assignment.

``Planning`` owns the current signed ``Plan`` and what the coordinator derives from it when it makes it
(``planned``: peer -> block and endpoint; reachability, TLS pins and signing keys of the planned peers),
plus the checkpoint the current plan restored. It makes plans (``_plan_for``: ``placement.place`` over
``cost_model.py``: the chain sized after ordering the peers, peers behind NAT kept apart, spare peers as
replicas of the slowest stage) and builds the gRPC ``Assignment`` a peer gets. Publishing a plan in the
DHT is ``roster.Roster.publish``'s job. Every plan names each link's codecs (``coordinator/wire_choice.py``:
the run's, or under ``--wire-* auto`` one per link from its measured bandwidth).
"""

from __future__ import annotations

from dataclasses import asdict

from coordinator.checkpoint_store import CheckpointStore
from coordinator.cost_model import ModelSpec, PeerSpec
from coordinator.membership import Membership, make_plan
from coordinator.placement import NoFit, PlacementError, Unarrangeable, place
from coordinator.plan_inputs import block_overhead, boundary_elements, model_spec, peer_specs
from coordinator.progress import Progress
from coordinator.run_settings import NoPlanFits, RunFailed, RunSettings
from coordinator.run_state import CoordinatorState
from coordinator.wire_choice import choose_links
from swarm.config import WIRE_AUTO, backward_ladder, forward_ladder
from swarm.dht.plan_view import plan_view
from swarm.dht.records import seal_plan
from swarm.dht.schema import PeerRecord, Plan
from swarm.messages import hf_to_pb, model_to_pb, train_to_pb
from swarm.pb import control_pb2 as cpb
from swarm.security.identity import plan_keys
from swarm.sizes import format_size
from swarm.train.measure import planned_layer

Stages = list[tuple[int, int, list[tuple[str, str]]]]  # (layer_start, layer_end, [(peer id, endpoint)])


class Planning:
    def __init__(
        self, settings: RunSettings, membership: Membership, progress: Progress, store: CheckpointStore
    ) -> None:
        self.s = settings
        self.membership = membership
        self.progress = progress
        self.store = store
        self.run_id = settings.name
        self.plan: Plan | None = None
        self.plan_version = 0
        self.planned: dict[str, tuple[int, int, str]] = {}  # peer id -> (layer_start, layer_end, endpoint)
        self.predicted_throughput = 0.0
        self.reachable: dict[str, bool] = {}
        self.fingerprints: dict[str, str] = {}  # peer id -> TLS fingerprint from its record ("" in clear)
        self.public_keys: dict[str, str] = {}  # peer id -> the key its record is signed with: signs its calls
        self.links_from: dict[str, PeerSpec] = {}  # peer id -> its measured link, as last planned (codec choice)
        self._restore_version = 0
        self.control_endpoint = ""  # set once the Control service listens: every plan names it

    def load(self, state: CoordinatorState) -> None:
        """Take over a saved run's plan and restore point."""
        self.plan = Plan.model_validate(state.plan) if state.plan is not None else None
        self.plan_version = self.plan.version if self.plan is not None else 0
        self.planned = {p: (a, b, e) for p, (a, b, e) in state.planned.items()}
        self.reachable = dict(state.reachable)
        if self.plan is not None:  # pins survive a restart: later plans (a replica lost) must keep them
            self.fingerprints = {p.peer_id: p.tls_fingerprint for st in self.plan.stages for p in st.peers}
            self.public_keys = plan_keys(self.plan)
        self._restore_version = state.restore_version

    @property
    def restore_version(self) -> int:
        """The checkpoint version the current plan started from (every Assignment names it)."""
        return self._restore_version

    @restore_version.setter
    def restore_version(self, version: int) -> None:
        self._restore_version = version

    @property
    def tls_fingerprint(self) -> str:
        """The certificate the Control service presents ("" in clear): every plan carries it, the first too."""
        return self.s.tls.fingerprint if self.s.tls is not None else ""

    def peer_key(self, peer_id: str) -> str | None:
        """The key of ``peer_id``'s signed record, pinned when it was planned: only its holder may call as it."""
        return self.public_keys.get(peer_id)

    def block(self, peer_id: str) -> tuple[int, int] | None:
        """The layers the current plan gives ``peer_id`` (None: not planned)."""
        planned = self.planned.get(peer_id)
        return planned[:2] if planned else None

    def describe(self) -> str:
        """``p=layers[a,b), ...``: the plan as the run's messages show it."""
        return ", ".join(f"{p}=layers[{a},{b})" for p, (a, b, _) in self.planned.items())

    def replicated(self, peer_id: str) -> bool:
        """Does another planned peer still hold this peer's block?"""
        block = self.planned.get(peer_id)
        return block is not None and any(p != peer_id and v[:2] == block[:2] for p, v in self.planned.items())

    def without(self, peer_id: str) -> Stages:
        """The current plan's stages with ``peer_id`` taken out (its block stays, held by the others or none)."""
        assert self.plan is not None
        return [
            (st.layer_start, st.layer_end, [(p.peer_id, p.endpoint) for p in st.peers if p.peer_id != peer_id])
            for st in self.plan.stages
        ]

    def links(self, stages: Stages) -> list[dict]:
        """Each link's codecs for ``stages``, from the peers' last measured links (``wire_choice``). A coordinator
        restarted since it measured them keeps the codecs the current plan gave the links that remain."""
        ids = [(a, b, [p for p, _ in peers]) for a, b, peers in stages]
        holders = {p for _, _, peers in ids for p in peers}
        if holders <= set(self.links_from):
            spec = model_spec(self.s.model, self.s.train, self.s.hf)
            elements = boundary_elements(self.s.model, self.s.train, self.s.hf)
            peers = {p: self.links_from[p] for p in holders}
            train = self.s.train
            width, zstd = self.s.model.d_model, train.wire_zstd
            ladders = forward_ladder(width, zstd=zstd), backward_ladder(width, zstd=zstd)
            choices = choose_links(ids, peers, spec, elements, train.wire_forward, train.wire_backward, *ladders)
            return [asdict(c) for c in choices]
        old = self.plan.links if self.plan is not None else []
        return [x.model_dump() for x in old if x.upstream in holders and x.downstream in holders]

    def publishable(self, stages: Stages) -> Plan:
        self.plan_version += 1
        links = self.links(stages)
        if WIRE_AUTO in (self.s.train.wire_forward, self.s.train.wire_backward):
            for x in links:
                self.progress.message(
                    f"link {x['upstream']} -> {x['downstream']} (stage {x['boundary']} -> {x['boundary'] + 1}): "
                    f"forward {x['forward']} ({x['forward_reason']}, {x['forward_mbit_s']:,.1f} Mbit/s), "
                    f"backward {x['backward']} ({x['backward_reason']}, {x['backward_mbit_s']:,.1f} Mbit/s)"
                )
        return make_plan(
            reachable=self.reachable,
            fingerprints=self.fingerprints,
            public_keys=self.public_keys,
            coordinator_tls_fingerprint=self.tls_fingerprint,
            swarm=self.s.swarm,
            run_id=self.run_id,
            version=self.plan_version,
            model_name=self.s.model_name,
            coordinator=self.control_endpoint,
            stages=stages,
            layer=planned_layer(self.s.model, self.s.train, self.s.hf),
            links=links,
        )

    # ---- making a plan and an Assignment (the placement rule the runtime uses) --------------------
    def plan_for(self, records: list[PeerRecord]) -> Plan:
        """The placement of ``coordinator/placement.py`` (chain, replicas, NAT rule) as a signed plan."""
        self.reachable = {r.peer_id: r.reachable is not False for r in records}
        blocks, groups, throughput = self.layout(records)
        endpoints = {r.peer_id: r.endpoint for r in records}
        self.fingerprints = {r.peer_id: r.tls_fingerprint for r in records}
        self.public_keys = {r.peer_id: r.public_key for r in records if r.public_key}
        overhead = block_overhead(self.s.model, self.s.train, self.s.hf)
        self.links_from = {p.peer_id: p for p in peer_specs(records, overhead=overhead)}
        stages = [(a, b, [(p, endpoints[p]) for p in group]) for (a, b), group in zip(blocks, groups, strict=True)]
        self.planned = {p: (a, b, endpoints[p]) for a, b, peers in stages for p, _ in peers}
        self.predicted_throughput = throughput
        replicated = [
            f"stage {i} layers [{a},{b}) x{len(g)}"
            for i, ((a, b), g) in enumerate(zip(blocks, groups, strict=True))
            if len(g) > 1
        ]
        if replicated:
            self.progress.message("replicas: " + ", ".join(replicated))
        behind_nat = [g[0] for g in groups if not self.reachable[g[0]]]
        if behind_nat:
            self.progress.message(f"behind NAT (they dial their neighbours): {', '.join(behind_nat)}")
        return self.publishable(stages)

    def layout(self, records: list[PeerRecord]) -> tuple[list[tuple[int, int]], list[list[str]], float]:
        """Blocks, their holders in pipeline order and the predicted micro-batches/s (no side effects)."""
        spec = model_spec(self.s.model, self.s.train, self.s.hf)
        overhead = block_overhead(self.s.model, self.s.train, self.s.hf)
        peers = peer_specs(records, overhead=overhead)
        try:
            placed = place(peers, spec, stages=self.s.stages, replicate=self.s.replicate)
        except NoFit as e:
            offered = {r.peer_id: float(r.free_memory_bytes) for r in records}
            raise NoPlanFits(no_fit_message(spec, peers, e, overhead=overhead, offered=offered)) from None
        except Unarrangeable as e:
            raise RunFailed(f"blocked on reachability: {e}") from None
        except PlacementError as e:
            raise RunFailed(f"no plan fits these peers: {e}") from None
        blocks = [(b.layer_start, b.layer_end) for b in placed.blocks]
        return blocks, [list(b.peer_ids) for b in placed.blocks], placed.throughput

    def holds_a_layer(self, record: PeerRecord) -> bool:
        """Does this peer offer the memory of the smallest layer? (One that does not can be in no plan.)"""
        return record.free_memory_bytes >= min(model_spec(self.s.model, self.s.train, self.s.hf).layer_memory)

    def assignment(self, peer_id: str) -> cpb.Assignment:
        """The configs and restore point for ``peer_id``, with the sealed plan it derives its place from."""
        plan_view(self.plan, peer_id)  # the plan must give this peer a block
        sealed = seal_plan(self.plan, self.membership.key)
        return cpb.Assignment(
            run_id=self.run_id,
            model=model_to_pb(self.s.model),
            train=train_to_pb(self.s.train),
            hf=hf_to_pb(self.s.hf) if self.s.hf else None,
            restore_version=self._restore_version,
            epoch=self.store.epoch,
            plan=cpb.SignedPlan(body=sealed["body"], sig=sealed["sig"]),
        )


def no_fit_message(
    spec: ModelSpec, peers: list[PeerSpec], error: NoFit, *, overhead: float, offered: dict[str, float]
) -> str:
    """One line naming the limit: the memory the model needs against what each peer ``offered``.

    ``peers`` carry their memory less ``overhead`` (what any block holds whatever its size), floored at 0, so
    the line names the offer itself: a user compares it with the ``--memory`` they gave.
    """
    need, per_layer = sum(spec.layer_memory), max(spec.layer_memory)
    offers = ", ".join(f"{p.peer_id} {format_size(offered[p.peer_id])}" for p in peers)
    detail = f" ({error})" if str(error).startswith("spare") else ""
    fixed = f" plus {format_size(overhead)} per block" if overhead else ""
    return (
        f"no plan fits the peers' memory: the model's {len(spec.layer_memory)} layers need {format_size(need)}"
        f"{fixed} (up to {format_size(per_layer)} per layer), the peers offer {offers}{detail}; "
        "add peers, give them more memory (ravn-peer join --memory), or use --quant int8/nf4"
    )
