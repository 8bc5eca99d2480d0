"""One peer's view of the signed plan: the only place a stage, its neighbours and who dials whom are derived.

The coordinator builds assignments from it and the peer acts on it, both from the same signed
``Plan``; nothing else re-derives neighbours, so the two ends cannot disagree about a link.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config import AUTO_BACKWARD_LADDER, AUTO_FORWARD_LADDER, WIRE_AUTO, planned_codec
from swarm.dht.schema import Plan, PlanPeer


class PlanViewError(ValueError):
    """The plan gives this peer no block."""


@dataclass(frozen=True)
class PlanView:
    """Where ``peer_id`` sits in ``plan``; holders are peer id -> endpoint, in plan order."""

    plan: Plan
    peer_id: str
    stage: int
    layers: tuple[int, int]
    me: PlanPeer
    upstreams: dict[str, str]  # every holder of the previous block
    downstreams: dict[str, str]  # every holder of the next block
    replicas: dict[str, str]  # every holder of this block, this peer included
    dial_upstream: bool  # this peer is behind NAT: it opens the links to its upstream holders
    accept_downstream: bool  # a downstream holder is behind NAT: it dials us, we never dial it
    sends_forward: str | None = None  # the plan's codec for the activations this peer sends (None: unnamed)
    sends_backward: dict[str, str] | None = None  # upstream holder -> the plan's codec for gradients to it

    @property
    def num_stages(self) -> int:
        return len(self.plan.stages)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def replicated(self) -> bool:
        return len(self.replicas) > 1

    def to_dial(self) -> list[tuple[str, str, str]]:
        """(side, peer, endpoint) of every link this peer opens; the other links are opened by the far end."""
        downs = [] if self.accept_downstream else [("downstream", p, e) for p, e in self.downstreams.items()]
        ups = [("upstream", p, e) for p, e in self.upstreams.items()] if self.dial_upstream else []
        return downs + ups


def stage_of(plan: Plan, peer_id: str) -> int | None:
    """The index of the stage ``peer_id`` holds in ``plan``, or None."""
    return next((i for i, st in enumerate(plan.stages) if any(p.peer_id == peer_id for p in st.peers)), None)


def plan_view(plan: Plan, peer_id: str) -> PlanView:
    """``peer_id``'s stage, layers, neighbours, replicas and dial directions in ``plan``.

    A boundary always has one side that accepts connections (the planner never makes two peers behind
    NAT neighbours): a peer behind NAT dials its upstream holders, and a peer whose downstream block has
    a holder behind NAT waits to be dialled on that side.
    """
    index = stage_of(plan, peer_id)
    if index is None:
        raise PlanViewError(f"the signed plan v{plan.version} gives peer {peer_id} no block")
    stages = plan.stages
    st = stages[index]
    ups = stages[index - 1].peers if index > 0 else []
    downs = stages[index + 1].peers if index + 1 < len(stages) else []
    me = next(p for p in st.peers if p.peer_id == peer_id)
    return PlanView(
        plan=plan,
        peer_id=peer_id,
        stage=index,
        layers=(st.layer_start, st.layer_end),
        me=me,
        upstreams={p.peer_id: p.endpoint for p in ups},
        downstreams={p.peer_id: p.endpoint for p in downs},
        replicas={p.peer_id: p.endpoint for p in st.peers},
        dial_upstream=bool(ups) and not me.reachable,
        accept_downstream=bool(downs) and not all(p.reachable for p in downs),
        sends_forward=next((x.forward for x in plan.links if x.upstream == peer_id), None),
        sends_backward={x.upstream: x.backward for x in plan.links if x.downstream == peer_id},
    )


@dataclass(frozen=True)
class WireCodecs:
    """What this peer sends with: ``forward`` for activations, ``backward_to[holder]`` for the gradients
    going back to that upstream holder (``backward`` where the plan names none)."""

    forward: str
    backward: str
    backward_to: dict[str, str]


def wire_codecs(view: PlanView, forward: str, backward: str) -> WireCodecs:
    """The codecs of this peer's links: the plan's where it names them, else the run's ``forward``/``backward``.

    A run that leaves a direction to the plan (``auto``) needs the plan to name every link of this peer
    in it: a plan that does not is refused (PlanViewError), since no codec is left to fall back on.
    """
    fwd = view.sends_forward
    if fwd is None:
        if forward == WIRE_AUTO and view.downstreams:
            first = next(iter(view.downstreams))
            raise PlanViewError(
                f"the signed plan v{view.plan.version} gives the link {view.peer_id} -> {first} no forward codec, "
                "and the run chose codecs per link (--wire-forward auto)"
            )
        fwd = planned_codec(forward, AUTO_FORWARD_LADDER)
    named = view.sends_backward or {}
    if backward == WIRE_AUTO:
        unnamed = [p for p in view.upstreams if p not in named]
        if unnamed:
            raise PlanViewError(
                f"the signed plan v{view.plan.version} gives the link {unnamed[0]} -> {view.peer_id} no backward "
                "codec, and the run chose codecs per link (--wire-backward auto)"
            )
    return WireCodecs(forward=fwd, backward=planned_codec(backward, AUTO_BACKWARD_LADDER), backward_to=dict(named))
