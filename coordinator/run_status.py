"""The status snapshot of a running swarm (what ``Control.Status`` serves and `ravn status` renders).

Pure reading: it takes the run's parts and builds ``status_view.SwarmStatus``; nothing here changes the
run. The types and the rendering live in ``status_view``.
"""

from __future__ import annotations

import time

from coordinator.planning import Planning
from coordinator.progress import Progress
from coordinator.run_flow import RunFlow
from coordinator.run_record import RunRecord
from coordinator.run_settings import RunSettings
from coordinator.sessions import Sessions
from coordinator.status_data import (
    ExcludedPeer,
    LinkStatus,
    RunStatus,
    SwarmStatus,
    blocks_from_peers,
    eta_seconds,
    peer_status_from_stats,
)
from swarm.wire.codec_policy import feeds_back


def swarm_status(
    s: RunSettings,
    planning: Planning,
    sessions: Sessions,
    record: RunRecord,
    flow: RunFlow,
    progress: Progress,
    heartbeat_s: float,
) -> SwarmStatus:
    """The swarm as `ravn status` shows it: run progress, each peer, each block."""
    tokens_per_mb = s.train.micro_batch_size * s.model.context
    plan = planning.plan
    peers = []
    for x in sessions.peers.values():
        a, b = planning.planned.get(x.peer_id, (0, 0, ""))[:2]
        if b == 0 and plan is not None and x.stage is not None and x.stage < len(plan.stages):
            a, b = plan.stages[x.stage].layer_start, plan.stages[x.stage].layer_end  # a lost peer
        if b == 0:
            continue  # no block to show (its row would not parse)
        (t0, then), (t1, now) = (x.window[0], x.window[-1]) if x.window else ((0.0, None), (0.0, x.stats))
        peers.append(
            peer_status_from_stats(
                name=x.peer_id,
                device=x.device,
                block=(a, b),
                state=sessions.state_of(x),
                now=now,
                then=then if t1 > t0 else None,
                window_s=t1 - t0,
                heartbeat_age_s=time.monotonic() - x.last_seen,
                tokens_per_micro_batch=tokens_per_mb,
            )
        )
    blocks: tuple = ()
    if plan is not None and any(st.peers for st in plan.stages):
        ranges = [(st.layer_start, st.layer_end) for st in plan.stages]
        replicas = {r: sum(1 for a, b, _ in planning.planned.values() if (a, b) == r) for r in ranges}
        blocks = blocks_from_peers(peers, ranges, replicas=replicas)
    steps = len(record.step_tokens)
    tokens = sum(record.step_tokens)
    wire = sum(x.stats.bytes_sent for x in sessions.peers.values())
    run = RunStatus(
        name=planning.run_id,
        step=steps,
        total_steps=s.train.steps,
        loss=record.train_losses[-1][1] if record.train_losses else None,
        val_loss=record.val_losses[-1][1] if record.val_losses else None,
        tokens_per_s=progress.tokens_per_s or None,
        eta_s=eta_seconds(steps, s.train.steps, record.train_seconds()),
        wire_bytes_per_token=wire / tokens if tokens else None,
        loss_history=tuple(v for _, v in record.train_losses[-120:]),
        heartbeat_s=heartbeat_s,
        max_staleness=s.train.staleness_bound,
        waiting=flow.waiting,
        **flow.trouble(bool(s.train.checkpoint_every)),
    )
    excluded = tuple(ExcludedPeer(name=p, reason=why) for p, why in sessions.excluded.items())
    feedback = s.train.error_feedback_backward  # decided per link, by the link's gradient codec
    links = tuple(
        LinkStatus(**x.model_dump(), backward_error_feedback=feeds_back(feedback, x.backward))
        for x in (plan.links if plan is not None else ())
    )
    return SwarmStatus(
        run=run,
        peers=tuple(peers),
        blocks=blocks,
        swarm=s.swarm,
        generated_at=time.time(),
        excluded=excluded,
        links=links,
    )
