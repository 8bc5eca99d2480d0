"""Issue 16 item 6: a stage bounds every received tensor by its own assignment before allocating.

Unit checks of ``swarm.wire.receive_bounds``, the in-process daemon of tests/test_fuzz.py (real gRPC on
loopback), and a separate peer process (tests/lone_peer.py, auth and limit interceptors on) whose
peak memory must not move when a member claims a 2^27-element activation.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from swarm.config import TrainConfig
from swarm.dht.signing import new_key
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.security import auth
from swarm.security.identity import public_key_text
from swarm.security.limits import LimitExceeded
from swarm.wire.packets import WireError, split_packet, tensor_to_pb
from swarm.wire.receive_bounds import link_bounds
from tests.swarm_procs import Proc, assert_all_gone
from tests.test_fuzz import (
    CFG,
    HELLO_FRAMES,
    MASKED_STATUS,
    STREAM_TIMEOUT,
    B,
    T,
    exchange_status,
    good_frames,
    raw_channel,
    served_gradient,
    stream,
    with_fresh_peer,
)

D = CFG.d_model


def int4_tensor(shape: list[int]) -> pb.Tensor:
    """A consistent int4 tensor of ``shape`` (zero payload, zero scales): decoding it allocates 4 bytes/element."""
    n = int(np.prod(shape, dtype=np.int64))
    return pb.Tensor(
        shape=shape,
        dtype=pb.FLOAT32,
        codec=pb.INT4,
        payload=bytes((n + 1) // 2),
        scales=bytes(2 * -(-n // 64)),
        block_size=64,
    )


def activations(hidden: pb.Tensor, mb_id: int = 1) -> pb.Packet:
    targets = tensor_to_pb(torch.zeros(B, T, dtype=torch.int16), "raw")
    return pb.Packet(activations=pb.Activations(mb=pb.MicroBatch(id=mb_id), hidden=hidden, targets=targets))


# ---- the bounds alone ------------------------------------------------------------------------------


def test_bounds_follow_the_assignment() -> None:
    bounds = link_bounds(CFG, TrainConfig(micro_batch_size=B))
    bounds.check_packet(activations(int4_tensor([B, T, D])))  # what an honest upstream sends
    bounds.check_packet(activations(int4_tensor([1, 3, D])))  # a shorter micro-batch is fine
    for shape in ([B, T, 2 * D], [B, CFG.context + 1, D], [B + 1, T, D], [1 << 27]):
        with pytest.raises(LimitExceeded):
            bounds.check_packet(activations(int4_tensor(shape)))
    with pytest.raises(WireError, match="dimensions"):
        bounds.check_packet(activations(int4_tensor([B * T, D])))
    with pytest.raises(WireError, match="negative"):
        bounds.check_packet(activations(pb.Tensor(shape=[B, -1, D])))
    with pytest.raises(LimitExceeded):
        bounds.check_packet(pb.Packet(gradients=pb.Gradients(grad=int4_tensor([B, T, D + 1]))))
    assert bounds.max_packet_bytes < 1 << 20  # gpt-tiny, 2 sequences: far below the global 256 MiB


# ---- the live daemon (in process) ----------------------------------------------------------------


def test_an_oversized_activation_header_is_refused_before_decoding() -> None:
    """Small enough for the packet bound, but the header claims 8x the hidden size: refused on the header."""

    async def scenario(daemon, target: str) -> None:
        frames = HELLO_FRAMES + list(split_packet(activations(int4_tensor([B, T, 8 * D])), 1))
        code, details = await exchange_status(target, frames)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "does not fit this stage" in details, details
        assert await served_gradient(target, good_frames(2)) is not None

    with_fresh_peer(scenario)


def test_a_packet_larger_than_the_stage_needs_is_refused_at_its_first_frame() -> None:
    async def scenario(daemon, target: str) -> None:
        async with raw_channel(target) as channel:
            call = wgrpc.StageStub(channel).Link()
            for f in HELLO_FRAMES:
                await call.write(f)
            await asyncio.wait_for(call.read(), 10)  # the peer's hello: the link is up
            with contextlib.suppress(Exception):  # the peer may end the call while we write: that is the refusal
                await call.write(pb.Frame(packet_id=1, data=bytes(1 << 20), total_size=10 << 20))
            # no more data and no half-close: a bounded peer ends the call now, an unbounded one waits for 9 MiB
            code = await asyncio.wait_for(call.code(), 5.0)
            details = await call.details()
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "exceeds the limit" in details, details

    with_fresh_peer(scenario)


# ---- a separate peer process with auth and limits -------------------------------------------------


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_peer_process_does_not_allocate_for_a_huge_activation_claim() -> None:
    """Before the bounds, 68 MiB of int4 claiming 2^27 elements made the peer decode 512 MiB (peak RSS +512 MB)."""
    token = auth.generate_token()
    upstream = new_key()
    proc = Proc([sys.executable, "-m", "tests.lone_peer", token, public_key_text(upstream)])
    try:
        _, m = proc.wait_for(r"serving (\S+)", 120)
        target = m.group(1)

        async def main() -> tuple[grpc.StatusCode, str, torch.Tensor | None]:
            interceptors = auth.client_interceptors(token, "upstream", "last", signer=upstream)
            async with grpc.aio.insecure_channel(target, interceptors=interceptors) as channel:
                ok = await asyncio.wait_for(stream(channel, good_frames(1)), STREAM_TIMEOUT)  # warm up
                assert ok[1] == grpc.StatusCode.OK, ok[1:3]
                before = peak_rss_mb(proc.popen.pid)
                huge = activations(int4_tensor([B, T, (1 << 27) // (B * T)]), 2)
                _, code, details, _ = await asyncio.wait_for(
                    stream(channel, HELLO_FRAMES + list(split_packet(huge, 1))), STREAM_TIMEOUT
                )
                grown = peak_rss_mb(proc.popen.pid) - before
                _, again, _, _ = await asyncio.wait_for(stream(channel, good_frames(3)), STREAM_TIMEOUT)
                return code, f"{details} (peak RSS grew {grown:.0f} MB)", grown, again

        code, details, grown, again = asyncio.run(main())
        # INTERNAL "from Core": grpc.aio's client masks the peer's refusal when a write races it (see test_fuzz)
        refused = code == grpc.StatusCode.INVALID_ARGUMENT or details.startswith(MASKED_STATUS)
        assert refused, (code, details)
        assert grown < 100, details
        assert again == grpc.StatusCode.OK  # the peer still serves its real upstream
    finally:
        pids = proc.tree()
        proc.stop()
        assert_all_gone(pids)
