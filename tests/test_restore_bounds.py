"""Issue 16 item 6, the peer's side of a checkpoint: what it restores must be its own block's state.

A peer restoring after a recovery receives its block's weights and AdamW moments from the coordinator
(``Control.FetchState``). Before, it accepted any packet up to 512 MiB and decoded any tensor up to the
global element cap, whatever its name or shape; now the packet is capped at the block's state and every
tensor is checked against the block, and a wrong state is a clear error, never loaded.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from peer.checkpoints import restore_block
from peer.compute import ComputeWorker
from peer.plan_trust import AssignmentError
from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.pb import control_pb2 as cpb
from swarm.train.model import StageModel
from swarm.train.stage_runner import StageRunner
from swarm.wire.packets import split_packet, tensor_to_pb

CFG = MODEL_PRESETS["gpt-tiny"]


class ServingControl:
    """Answers FetchState with one fixed state chunk, as the coordinator's service would."""

    def __init__(self, chunk: cpb.StateChunk) -> None:
        self.chunk = chunk

    def FetchState(self, request, timeout=None):  # noqa: N802 - the stub's name
        async def frames():
            for f in split_packet(self.chunk, 1):
                yield f

        return frames()


def state_chunk(tensors: dict[str, torch.Tensor]) -> cpb.StateChunk:
    chunk = cpb.StateChunk(peer_id="p1", version=5)
    for name, t in tensors.items():
        chunk.tensors.add(name=name, tensor=tensor_to_pb(t, "fp32", allow_nonfinite=True))
    return chunk


def restore(tensors: dict[str, torch.Tensor]) -> StageRunner:
    async def scenario() -> StageRunner:
        runner, compute = StageRunner(CFG, TrainConfig(), 1, 3), ComputeWorker()
        try:
            await restore_block(ServingControl(state_chunk(tensors)), "p1", runner, 5, compute.run)
            return runner
        finally:
            await asyncio.to_thread(compute.close)

    return asyncio.run(scenario())


def test_a_peer_restores_its_own_blocks_state() -> None:
    good = {k: torch.full_like(v, 0.5) for k, v in StageModel(CFG, 1, 3).state_dict().items()}
    runner = restore(good)
    assert all(torch.equal(runner.state_dict()[k], v) for k, v in good.items())


@pytest.mark.parametrize("why", ["does not match", "not part of this block", "lacks 1", "NaN or Inf", "exceeds"])
def test_a_state_that_is_not_the_blocks_is_refused_before_it_is_decoded(why: str) -> None:
    good = {k: torch.full_like(v, 0.5) for k, v in StageModel(CFG, 1, 3).state_dict().items()}
    name = next(iter(good))
    bad = {
        "does not match": {**good, name: torch.zeros(64, 65)},
        "not part of this block": {**good, "layers.0.attn.qkv.weight": torch.zeros(192, 64)},
        "lacks 1": {k: v for k, v in good.items() if k != name},
        "NaN or Inf": {**good, name: torch.full_like(good[name], float("nan"))},
        "exceeds": {**good, "padding": torch.zeros(1 << 20)},  # a packet far larger than the block's state
    }[why]
    with pytest.raises(AssignmentError, match=why):
        restore(bad)
