"""What a peer tells the coordinator: its stats, and reports that must arrive exactly once.

A report that carries more than stats (steps, evals, ready, finished, an error, leaving) is kept until the
coordinator has it and sent before anything newer, merged with whatever piled up meanwhile, also across
a coordinator restart (one call, however long the outage).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from peer.compute import ComputeWorker
from peer.stage import Stage
from swarm.metrics import PeerMetrics
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.wire.sanity import Quarantine

log = logging.getLogger(__name__)


def stage_stats(stage: Stage | None, compute: ComputeWorker) -> cpb.StageStats:
    """The counters of the current Stage (zeros before the first assignment) and of the compute thread."""
    idle = cpb.StageStats(idle_seconds=compute.idle_seconds, wall_seconds=time.monotonic() - compute.started)
    if stage is None:
        return idle
    r, group = stage.runner, stage.replicas.group
    sent, received = stage.links.bytes()
    m = r.metrics
    held, spilled = stage.deltas.held() if stage.deltas is not None else (0, 0)
    return cpb.StageStats(
        forward_micro_batches=m.forward,
        backward_micro_batches=m.backward,
        bytes_sent=sent,
        bytes_received=received,
        compute_seconds=m.compute_seconds,
        weight_version=r.version,
        refused=stage.refused,
        dropped=m.dropped,
        staleness_counts=m.staleness_counts(),
        idle_seconds=idle.idle_seconds,
        wall_seconds=idle.wall_seconds,
        kept_weights_bytes_peak=m.kept_weights_bytes_peak,
        held_gradient_bytes_peak=m.held_gradient_bytes_peak,
        in_flight_peak=m.in_flight_peak,
        average_rounds=group.rounds_applied if group else 0,
        average_bytes=group.bytes if group else 0,
        anchor_digest=stage.replicas.anchor_digest,
        lost_micro_batches=stage.lost_micro_batches,
        rejected=sum(stage.sanity.rejections.values()),
        rejected_by_sender=dict(stage.sanity.rejections),
        sent_codecs=dict(stage.policy.sent),
        delta_rows=held,
        delta_rows_spilled=spilled,
        memory=cpb.StageMemory(**stage.memory.sample().as_dict()),
    )


class Reporter:
    """Sends reports in the order they were made; keeps the undelivered ones (see the module docstring)."""

    def __init__(
        self,
        peer_id: str,
        stats: Callable[[], cpb.StageStats],
        quarantine: Quarantine,
        metrics: PeerMetrics,
        control: Callable[[], cgrpc.ControlStub | None],
        attached: Callable[[], bool],
    ) -> None:
        self.peer_id, self.stats, self.quarantine, self.metrics = peer_id, stats, quarantine, metrics
        self._control, self._attached = control, attached
        self.pending: cpb.StatusReport | None = None  # undelivered steps/evals/flags, merged; sent on re-attach
        self._lock = asyncio.Lock()

    async def report(self, **fields) -> None:
        stats = self.stats()
        self.metrics.update(stats)
        quarantined = [cpb.Quarantined(peer_id=p, reason=why) for p, why in self.quarantine.status().items()]
        msg = cpb.StatusReport(peer_id=self.peer_id, stats=stats, quarantined=quarantined, **fields)
        async with self._lock:
            if any(fields.values()):
                self.pending = merge_reports(self.pending, msg)
            control = self._control()
            if control is None or not self._attached():
                return
            out = self.pending or msg
            out.stats.CopyFrom(stats)
            try:
                await control.Report(out, timeout=10.0)
                if out is self.pending:
                    self.pending = None
            except grpc.aio.AioRpcError as e:
                log.warning("report to the coordinator failed: %s", e.details())

    async def fail(self, reason: str, *, epoch: int = 0) -> None:
        """A fault this peer cannot repair: tell the coordinator, which decides what happens next.

        ``epoch``: the plan epoch of the block it is about (0: the peer's own). A block of a plan the run
        has left sees its links close as its neighbours move to the new plan; the coordinator drops such
        a fault instead of recovering again."""
        log.error(reason)
        await self.report(error=reason, error_epoch=epoch)


def merge_reports(pending: cpb.StatusReport | None, new: cpb.StatusReport) -> cpb.StatusReport:
    """One report that says everything ``pending`` and ``new`` say, in order (one call, however long the outage)."""
    if pending is None:
        merged = cpb.StatusReport()
        merged.CopyFrom(new)
        return merged
    pending.steps.extend(new.steps)
    pending.evals.extend(new.evals)
    pending.ready |= new.ready
    pending.finished |= new.finished
    pending.leaving |= new.leaving
    if not pending.error:
        pending.error, pending.error_epoch = new.error, new.error_epoch
    pending.stats.CopyFrom(new.stats)
    return pending


def status_line(stage: Stage, then: cpb.StageStats, now: cpb.StageStats, seconds: float) -> str:
    """The peer's one-line live status: what it holds and how fast it moves."""
    dt = max(seconds, 1e-9)
    mbs = (now.forward_micro_batches - then.forward_micro_batches) / dt
    up = (now.bytes_sent - then.bytes_sent) * 8 / dt / 1e6
    down = (now.bytes_received - then.bytes_received) * 8 / dt / 1e6
    busy = 1 - (now.idle_seconds - then.idle_seconds) / dt
    (start, end) = stage.view.layers
    return (
        f"training stage {stage.view.stage} layers [{start},{end}) | weights v{now.weight_version} | "
        f"{mbs:.1f} micro-batches/s | up {up:.1f} down {down:.1f} Mbit/s | compute busy {busy:.0%}"
        + (f" | dropped {now.dropped}" if now.dropped else "")
    )
