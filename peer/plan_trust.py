"""Which assignments a peer obeys: only those whose sealed plan the trusted coordinator key signed.

An ``Assignment`` carries the plan it belongs to, sealed exactly as the coordinator publishes it in the
DHT. The peer checks the signature with the key it trusts (the one discovery pins for DHT plans), that
the plan is for this peer's run and that plans never go back in version, then derives its stage, layers,
neighbours, replicas and dial directions from the plan alone (``swarm.dht.plan_view``). Nothing else in the
assignment says where the peer sits, so nothing else can disagree with the signature.
"""

from __future__ import annotations

from hivemind.utils.crypto import RSAPublicKey

from swarm.config import WIRE_AUTO
from swarm.dht.plan_view import PlanView, PlanViewError, plan_view, wire_codecs
from swarm.dht.records import PLAN_ENVELOPE_VERSION, PlanVerificationError, verify_plan
from swarm.dht.schema import Plan
from swarm.pb import control_pb2 as cpb


class AssignmentError(ValueError):
    """An assignment this peer must not act on (unsigned, another run, an older plan, an impossible block)."""


class PlanTrust:
    """The trusted coordinator key and the newest plan version seen; checks every assignment's plan."""

    def __init__(self, key: RSAPublicKey, swarm: str, peer_id: str) -> None:
        self.key, self.swarm, self.peer_id = key, swarm, peer_id
        self.newest = 0  # the highest plan version this peer has acted on
        self.run_id = ""  # the run of the first plan acted on; a peer never changes run

    def accept(self, a: cpb.Assignment) -> PlanView:
        """This peer's place in the assignment's signed plan, or AssignmentError: never act on it then."""
        if not a.HasField("plan") or not a.plan.body:
            raise AssignmentError("the assignment carries no signed plan; refusing it")
        envelope = {"v": PLAN_ENVELOPE_VERSION, "body": a.plan.body, "sig": a.plan.sig}
        try:
            plan = verify_plan(envelope, self.swarm, self.key)
        except PlanVerificationError as e:
            raise AssignmentError(f"the assignment's plan is not signed by the trusted coordinator: {e}") from None
        # only what the run left to the plan matters here: the rest of the recipe is read when the block is built
        wire = tuple(WIRE_AUTO if auto else "" for auto in (a.train.wire_forward_auto, a.train.wire_backward_auto))
        return self.check(plan, a.run_id, wire=wire)

    def check(self, plan: Plan, run_id: str, *, wire: tuple[str, str] | None = None) -> PlanView:
        """Run and version checks of a verified plan, and (``wire``: the run's two codec choices) that it
        names a codec for each of this peer's links the run left to it; remembers its version."""
        if plan.run_id != run_id:
            raise AssignmentError(f"the assignment is for run {run_id!r}, its signed plan for {plan.run_id!r}")
        if self.run_id and plan.run_id != self.run_id:
            raise AssignmentError(f"signed plan for run {plan.run_id!r}; this peer trains run {self.run_id!r}")
        if plan.version < self.newest:
            raise AssignmentError(f"signed plan v{plan.version} is older than v{self.newest}, already acted on")
        try:
            view = plan_view(plan, self.peer_id)
            if wire is not None:
                wire_codecs(view, *wire)
        except PlanViewError as e:
            raise AssignmentError(str(e)) from None
        self.newest, self.run_id = plan.version, plan.run_id
        return view
