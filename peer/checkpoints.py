"""Block state between this peer and the coordinator's checkpoint store: periodic uploads, the final
upload at the end of a run, and the restore of a recovered block.

Periodic checkpoints belong to the Stage whose step took them: the upload runs as that Stage's task, so
a re-assignment drops it (the coordinator would refuse it anyway: its plan epoch is over). At most one
upload is in flight, so training runs at most one period ahead of what the coordinator holds and a
failure redoes fewer than 2C steps however slow uploads are.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

import grpc

from peer.faults import Faults, crash_due
from peer.plan_trust import AssignmentError
from peer.stage import Snapshot, Stage
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.train.checkpoint import state_digest
from swarm.train.stage_runner import StageRunner
from swarm.wire.packets import Reassembler, WireError, split_packet, tensor_to_pb
from swarm.wire.state_checks import BlockSpec, decode_state

log = logging.getLogger(__name__)
Compute = Callable[..., Awaitable]


class Checkpoints:
    """Uploads this peer's checkpoints over the current control stream (``control()``: None while away)."""

    def __init__(
        self,
        peer_id: str,
        control: Callable[[], cgrpc.ControlStub | None],
        attached: Callable[[], bool],
        faults: Faults,
    ) -> None:
        self.peer_id, self._control, self._attached, self.faults = peer_id, control, attached, faults
        self._upload: asyncio.Task | None = None  # the newest periodic upload

    async def on_snapshot(self, stage: Stage, snapshot: Snapshot) -> None:
        """A step of ``stage`` took a checkpoint: upload it in the background, one upload at a time."""
        previous = self._upload
        if previous is not None and not previous.done() and self._attached():
            await asyncio.wait([previous])
        if stage.closed:
            return
        self._upload = stage.spawn(self.upload(stage, *snapshot), name="checkpoint")

    async def upload(self, stage: Stage, version: int, weights: dict, optim: dict) -> None:
        """Upload a checkpoint of ``stage``'s block; never once that Stage is closed."""
        control = self._control()
        if control is None or stage.closed:
            return
        if crash_due(self.faults.crash_at_checkpoint, stage.view.stage, stage.number == 0, version):
            log.error("--debug-crash-at-checkpoint: dying instead of uploading checkpoint v%d", version)
            os._exit(3)
        a, (start, end) = stage.assignment, stage.view.layers

        def build() -> cpb.StateChunk:
            chunk = cpb.StateChunk(
                peer_id=self.peer_id,
                stage=stage.view.stage,
                version=version,
                layer_start=start,
                layer_end=end,
                periodic=True,
                epoch=a.epoch,
            )
            for name, t in weights.items():
                chunk.tensors.add(name=name, tensor=tensor_to_pb(t.float(), "fp32"))
            for name, t in optim.items():
                chunk.optimizer.add(name=name, tensor=tensor_to_pb(t.float(), "fp32"))
            return chunk

        chunk = await asyncio.to_thread(build)
        if stage.closed:
            log.info("checkpoint v%d dropped: re-assigned while it was being packed", version)
            return
        try:
            await control.UploadState(_frames(chunk, version), timeout=300)
        except grpc.aio.AioRpcError as e:
            if not stage.closed:
                log.warning("checkpoint v%d upload failed: %s", version, e.details())

    async def checkpoint_now(self, stage: Stage) -> None:
        """The coordinator asks for a checkpoint of the current weights (before a graceful hand-over)."""
        version, (weights, optim) = stage.runner.version, await stage.compute(stage.runner.checkpoint_state)
        await self.upload(stage, version, weights, optim)

    async def upload_final(self, stage: Stage) -> None:
        """The block's weights at the end of a run, named so the coordinator can check it is ours."""
        state = await stage.compute(stage.runner.state_dict)
        (start, end) = stage.view.layers
        chunk = cpb.StateChunk(peer_id=self.peer_id, stage=stage.view.stage, layer_start=start, layer_end=end)
        for name, tensor in state.items():
            chunk.tensors.add(name=name, tensor=tensor_to_pb(tensor.float(), "fp32"))
        reply = await patiently(lambda: self._control().UploadState(_frames(chunk, 1)))
        log.info("uploaded %d tensors of stage %d", reply.tensors, stage.view.stage)


async def restore_block(
    control: cgrpc.ControlStub, peer_id: str, runner: StageRunner, version: int, compute: Compute
) -> None:
    """Load ``runner``'s weights and optimizer state at ``version`` from the coordinator's store; only state
    shaped exactly like this block is accepted (checked before decoding)."""
    request = cpb.FetchStateRequest(peer_id=peer_id, version=version, names=runner.parameter_names())
    own = await compute(runner.state_dict)
    spec = BlockSpec({name: tuple(t.shape) for name, t in own.items()})
    reasm = Reassembler(max_packet_bytes=spec.max_state_bytes, message_type=cpb.StateChunk)
    chunk = None
    try:
        async for frame in control.FetchState(request, timeout=120):
            chunk = reasm.push(frame) or chunk
        if chunk is None:
            raise AssignmentError(f"the coordinator sent no state for version {version}")
        weights, optim = await asyncio.to_thread(decode_state, chunk, spec)
    except WireError as e:
        raise AssignmentError(f"the coordinator's state for version {version} is not this block's: {e}") from None
    await compute(runner.restore, version, weights, optim)
    digest = await asyncio.to_thread(state_digest, weights, optim)
    log.info("restored %d tensors at weight version %d (state digest %s)", len(weights), version, digest)


async def patiently(call, attempts: int = 6):
    """A unary call to the coordinator that its per-sender rate limit may refuse for a moment: retry
    RESOURCE_EXHAUSTED with backoff, so a busy moment is not mistaken for a lost coordinator."""
    delay = 0.2
    for attempt in range(attempts):
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == attempts - 1:
                raise
        await asyncio.sleep(delay)
        delay *= 2


async def _frames(chunk: cpb.StateChunk, sequence: int):
    for frame in split_packet(chunk, sequence):
        yield frame
