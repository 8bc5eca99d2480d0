"""The run's record: its state on disk, the step history, the final blocks, the summary and the plot.

Everything a run leaves behind under ``runs/<name>/`` is written from here: ``coordinator_state.json``
(``run_state.save_state``, after every plan and step report, so a restarted coordinator picks the run
up), ``metrics.jsonl`` and the model or adapter (``artifacts.RunArtifacts``), the per-stage summary and
``loss.png``. A restarted coordinator reads its losses back from ``metrics.jsonl`` (``load``).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Iterable

import torch

from coordinator.artifacts import RunArtifacts
from coordinator.checkpoint_store import CheckpointStore
from coordinator.membership import Membership
from coordinator.planning import Planning
from coordinator.progress import Progress
from coordinator.run_flow import RunFlow
from coordinator.run_settings import RunSettings, settings_record
from coordinator.run_state import CoordinatorState, read_events, save_state
from coordinator.sessions import PeerSession
from swarm.metrics import MetricsServer
from swarm.pb import control_pb2 as cpb
from swarm.wire.codec_policy import feeds_back

log = logging.getLogger(__name__)


class RunRecord:
    def __init__(
        self,
        settings: RunSettings,
        membership: Membership,
        planning: Planning,
        flow: RunFlow,
        store: CheckpointStore,
        progress: Progress,
    ) -> None:
        self.s = settings
        self.membership = membership
        self.planning = planning
        self.flow = flow
        self.store = store
        self.progress = progress
        self.artifacts = RunArtifacts(settings.run_dir)
        self.metrics_server = MetricsServer()
        self.metrics = self.metrics_server.coordinator(settings.swarm, settings.name)
        self.metrics.set_total_steps(settings.train.steps)
        self.port = 0  # the control port, once it listens (no state is saved before)
        self.train_losses: list[tuple[int, float]] = []
        self.val_losses: list[tuple[int, float]] = []
        self.step_tokens: list[int] = []
        self.train_t0 = 0.0
        self.baseline: dict[str, cpb.StageStats] = {}  # each peer's stats when training started
        self.last_step = -1
        self.resumed_through = -1  # steps up to here were logged before a restart: a peer's re-send is dropped
        self.logged_through = self.evaled_through = -1  # this timeline's newest logged step and validation
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.replica_states: dict[int, dict[str, dict[str, torch.Tensor]]] = {}  # stage -> peer -> final state
        self.uploaded: set[str] = set()
        self._dht_port: int | None = None

    # ---- state on disk (a restarted coordinator picks the run up) -------------------------------
    def snapshot(self, *, finished: bool = False) -> CoordinatorState:
        if self._dht_port is None:  # asks the DHT process: once, not at every report
            found = [re.search(r"/tcp/(\d+)", m) for m in self.membership.maddrs()]
            self._dht_port = next((int(m[1]) for m in found if m), 0)
        plan = self.planning.plan
        return CoordinatorState(
            run_id=self.planning.run_id,
            swarm=self.s.swarm,
            settings=settings_record(self.s),
            port=self.port,
            dht_port=self._dht_port,
            plan=plan.model_dump(mode="json") if plan is not None else None,
            planned=self.planning.planned,
            reachable=self.planning.reachable,
            started=self.flow.started,
            finished=finished,
            last_step=self.last_step,
            restore_version=self.planning.restore_version,
            train_seconds=self.train_seconds(),
            checkpoints=self.store.describe(),
            saved_at=time.time(),
        )

    def save_state(self, *, finished: bool = False) -> None:
        """Write the run's state atomically; runs on the event loop after every plan and step report."""
        if not self.port:
            return
        try:
            save_state(self.s.run_dir, self.snapshot(finished=finished))
        except OSError as e:
            log.warning("could not save the coordinator state: %s", e)

    def load(self, state: CoordinatorState) -> None:
        """Take over a saved run's step count and losses (from metrics.jsonl)."""
        self.last_step = state.last_step
        for event in read_events(self.s.run_dir):
            if event.get("kind") == "step":
                if event["loss"] is not None:
                    self.train_losses.append((event["step"], event["loss"]))
                self.step_tokens.append(event["tokens"])
                self.last_step = event["step"]
            elif event.get("kind") == "eval":
                self.val_losses.append((event["step"], event["loss"]))
        self.resumed_through = self.last_step
        self.progress.step = self.last_step
        if state.started:
            self.train_t0 = time.monotonic() - state.train_seconds
        if state.started and self.last_step + 1 >= self.s.train.steps:
            self.flow.finished.set()  # killed while collecting the blocks: the final report will not come again

    def train_seconds(self) -> float:
        return time.monotonic() - self.train_t0 if self.train_t0 else 0.0

    # ---- steps and validations ------------------------------------------------------------------
    def redo_from(self, version: int) -> None:
        """A recovery restored checkpoint ``version``: its steps and validations are redone and count again."""
        self.resumed_through = -1
        self.logged_through = self.evaled_through = version - 1

    def add_steps(self, r: cpb.StatusReport) -> bool:
        """Log a report's new steps and validations; a report re-sent after the coordinator had it adds none.
        True when it carried a new step."""
        steps = [st for st in r.steps if st.step > max(self.resumed_through, self.logged_through)]
        evals = [ev for ev in r.evals if ev.step > max(self.resumed_through, self.evaled_through)]
        if len(steps) < len(r.steps):
            log.info("dropped %d step reports already logged (a re-sent report)", len(r.steps) - len(steps))
        if steps:
            self.logged_through = max(st.step for st in steps)
        if evals:
            self.evaled_through = max(ev.step for ev in evals)
        for st in steps:
            # a step none of whose micro-batches came through (all dropped) has no loss: the driver's 0.0 says
            # nothing, and shown as a loss it looked like a perfect step
            loss = st.loss if st.tokens else None
            if loss is None:
                log.warning("step %d: every micro-batch was dropped; it has no loss", st.step + 1)
            else:
                self.train_losses.append((st.step, loss))
            self.last_step = st.step
            self.artifacts.log("step", step=st.step, loss=loss, tokens=st.tokens, seconds=st.seconds)
            self.progress.on_step(st.step, math.nan if loss is None else loss, st.tokens, st.seconds)
            self.step_tokens.append(st.tokens)
            self.metrics.on_step(st.step, math.nan if loss is None else loss, st.tokens)
        for ev in evals:
            self.val_losses.append((ev.step, ev.loss))
            self.artifacts.log("eval", step=ev.step, loss=ev.loss, tokens=ev.tokens)
            self.progress.on_eval(ev.step, ev.loss)
            self.metrics.on_eval(ev.step, ev.loss)
        return bool(steps)

    # ---- checkpoints and the final blocks -------------------------------------------------------
    def on_checkpoint(
        self, chunk: cpb.StateChunk, weights: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]
    ) -> None:
        """A stage's periodic state (runs on a worker thread): file it; note when a version completes."""
        self.store.save(chunk.epoch, chunk.version, chunk.layer_start, chunk.layer_end, weights, optim)
        if self.store.is_complete(chunk.version):
            self.store.write_index()
            self.artifacts.log("checkpoint", version=chunk.version)

    def on_state(self, peer_id: str, stage: int, tensors: dict[str, torch.Tensor], attached: Iterable[str]) -> None:
        """A peer's final block; once every attached peer's is in, the run can write the model."""
        self.states[stage] = tensors
        self.replica_states.setdefault(stage, {})[peer_id] = tensors
        self.uploaded.add(peer_id)
        if self.uploaded >= set(attached):
            self.flow.states_in.set()

    def replica_disagreement(self) -> float | None:
        """Largest absolute difference between replicas of one block in the final upload (None: no replicas)."""
        worst = None
        for by_peer in self.replica_states.values():
            states = list(by_peer.values())
            for other in states[1:]:
                for name, t in states[0].items():
                    diff = float((t.float() - other[name].float()).abs().max()) if t.numel() else 0.0
                    worst = diff if worst is None else max(worst, diff)
        return worst

    def write_model(self) -> None:
        """The merged blocks as ``model.safetensors`` (or a peft adapter for LoRA runs)."""
        merged: dict[str, torch.Tensor] = {}
        for stage in sorted(self.states):
            merged.update(self.states[stage])
        if self.s.hf is not None:
            path = self.artifacts.write_adapter(merged, self.s.hf)
            self.progress.message(f"LoRA adapter (loads with peft on {self.s.hf.path}): {path}")
            return
        path = self.artifacts.write_checkpoint(
            merged, self.s.model, {"run_id": self.planning.run_id, "step": str(self.last_step + 1)}
        )
        self.progress.message(f"checkpoint: {path}")

    # ---- the summary and the plot ---------------------------------------------------------------
    def _stage_summary(self, session: PeerSession) -> dict:
        st, base = session.stats, self.baseline.get(session.peer_id, cpb.StageStats())
        wall = st.wall_seconds - base.wall_seconds
        return {
            "peer": session.peer_id,
            "stage": session.stage,
            "weight_version": st.weight_version,
            "staleness_counts": list(st.staleness_counts),
            "dropped": st.dropped,
            "bubble_fraction": (st.idle_seconds - base.idle_seconds) / wall if wall > 0 else None,
            "compute_seconds": st.compute_seconds - base.compute_seconds,
            "bytes_sent": st.bytes_sent,
            "kept_weights_bytes_peak": st.kept_weights_bytes_peak,
            "held_gradient_bytes_peak": st.held_gradient_bytes_peak,
            "in_flight_peak": st.in_flight_peak,
            "average_rounds": st.average_rounds,
            "average_bytes": st.average_bytes,
            "anchor_digest": st.anchor_digest,
            "forward_micro_batches": st.forward_micro_batches - base.forward_micro_batches,
            "sent_codecs": dict(sorted(st.sent_codecs.items())),  # tensors sent, by direction and codec
            "delta_rows": {"held": st.delta_rows, "spilled": st.delta_rows_spilled},  # both ends of its links
            "memory": memory_summary(st.memory),
        }

    def link_summary(self) -> list[dict]:
        """The last plan's links: stage i -> i + 1, sender and receiver, the codec of each direction, the
        measured Mbit/s it was chosen from and why (``coordinator/wire_choice.py``), and whether its gradients
        carry error feedback (``--error-feedback-backward``, decided per link)."""
        plan = self.planning.plan
        feedback = self.s.train.error_feedback_backward
        return [
            {
                "stages": [x.boundary, x.boundary + 1],
                **x.model_dump(),
                "backward_error_feedback": feeds_back(feedback, x.backward),
            }
            for x in (plan.links if plan is not None else [])
        ]

    def write_summary(self, sessions: list[PeerSession]) -> None:
        tokens = sum(self.step_tokens)
        wire = sum(x.stats.bytes_sent for x in sessions)
        seconds = self.train_seconds()
        summary = {
            "steps": len(self.step_tokens),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            # the planner's cost model for the last plan (slowest stage, no pipeline bubble): docs/SCALING.md
            "predicted_tokens_per_s": self.planning.predicted_throughput
            * self.s.train.micro_batch_size
            * self.s.model.context,
            "wire_bytes": wire,
            "wire_bytes_per_token": wire / tokens if tokens else 0.0,
            "effective_batch_tokens": self.s.train.micro_batches * self.s.train.micro_batch_size * self.s.model.context,
            "wire_forward": self.s.train.wire_forward,
            "wire_backward": self.s.train.wire_backward,
            "error_feedback_backward": self.s.train.error_feedback_backward,
            "wire_zstd": self.s.train.wire_zstd,
            "final_val_loss": self.val_losses[-1][1] if self.val_losses else None,
            "replica_max_abs_diff": self.replica_disagreement(),
            "average_bytes": sum(x.stats.average_bytes for x in sessions),
            "lost_micro_batches": sum(x.stats.lost_micro_batches for x in sessions),
        }
        summary["stages"] = [self._stage_summary(x) for x in sorted(sessions, key=lambda x: x.stage)]
        summary["links"] = self.link_summary()
        self.artifacts.log("summary", **summary)
        if tokens:
            self.progress.message(
                f"trained {tokens:,} tokens in {seconds:.0f} s ({summary['tokens_per_s']:,.0f} tok/s); "
                f"wire {wire / 1e6:,.1f} MB, {summary['wire_bytes_per_token']:,.0f} bytes/token"
            )

    def write_plot(self) -> None:
        plot = self.artifacts.plot_losses(self.train_losses, self.val_losses)
        if plot is not None:
            self.progress.message(f"loss curve: {plot}")
        if self.val_losses:
            self.progress.message(f"final validation loss: {self.val_losses[-1][1]:.4f}")
        self.progress.message(f"run artefacts: {self.artifacts.dir}")


def memory_summary(m: cpb.StageMemory) -> dict:
    """A stage's memory as its peer measured it (swarm/train/memory.py), with the load's excess over the block."""
    out = {f.name: getattr(m, f.name) for f in cpb.StageMemory.DESCRIPTOR.fields}
    # the "one tensor in flight" check: what the build held beyond the block it built
    out["load_peak_over_block"] = m.load_peak - m.block_bytes
    out["cuda_load_peak_over_block"] = m.cuda_load_peak - m.block_bytes if m.cuda_before or m.cuda_load_peak else 0
    return out
