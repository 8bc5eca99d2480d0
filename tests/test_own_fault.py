"""A stage that cannot encode its own result is at fault itself, never the neighbour that sent the input.

Issue 16 item 7: the encode error inside ``_forward_job`` used to end the *upstream's* stream with
INVALID_ARGUMENT and count a refusal against it. Real daemon, real gRPC on loopback (tests/test_fuzz.py's
target: the last stage of a 2-stage gpt-tiny).
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from peer.daemon import PeerDaemon
from swarm.wire.packets import Reassembler
from tests.test_fuzz import STREAM_TIMEOUT, good_frames, raw_channel, stream, with_fresh_peer


def test_a_stage_whose_own_encode_fails_keeps_its_upstream_uncharged() -> None:
    async def scenario(daemon: PeerDaemon, target: str) -> None:
        runner = daemon.stage.runner
        forward = runner.forward

        def beyond_fp16(*args, **kwargs):  # this stage's own input gradient is too large for its codec
            result = forward(*args, **kwargs)
            grad = result.input_grad / result.input_grad.abs().max() * 1e6  # sanity would admit this
            return dataclasses.replace(result, input_grad=grad)

        runner.forward = beyond_fp16
        daemon.stage.policy.backward = "fp16"
        async with raw_channel(target) as channel:
            _, code, details, replies = await asyncio.wait_for(stream(channel, good_frames(5)), STREAM_TIMEOUT)
        assert code == grpc.StatusCode.OK, (code, details)  # the upstream's stream is not refused
        assert daemon.stage.refused == 0 and not daemon.stage.sanity.rejections
        reasm = Reassembler()
        packets = [p for p in map(reasm.push, replies) if p is not None]
        grads = [p.gradients for p in packets if p.WhichOneof("body") == "gradients"]
        assert len(grads) == 1 and grads[0].dropped  # the micro-batch is dropped, so nothing waits for it

    with_fresh_peer(scenario)
