"""A live peer refuses bad input with a clear gRPC status and keeps serving.

The peer is the real daemon with its real gRPC server on loopback, holding the last stage of a
2-stage gpt-tiny; the test dials its Stage.Link as the upstream neighbour would.
"""

import asyncio

import grpc
import torch

from peer.daemon import PeerDaemon
from swarm.config import MODEL_PRESETS, PROTOCOL_VERSION, TrainConfig
from swarm.dht.multiaddrs import multiaddr_to_grpc_target
from swarm.messages import model_to_pb, train_to_pb
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.wire.packets import Reassembler, split_packet, tensor_from_pb, tensor_to_pb
from swarm.wire.transport import hello_packet
from tests.sealed_plans import assignment as sealed_assignment
from tests.sealed_plans import peer_settings

CFG = MODEL_PRESETS["gpt-tiny"]
B, T = 2, 16


def good_hidden() -> torch.Tensor:
    return torch.randn(B, T, CFG.d_model)


def activations(hidden: pb.Tensor, mb_id: int = 1) -> pb.Packet:
    targets = tensor_to_pb(torch.randint(0, 256, (B, T), dtype=torch.int16), "raw")
    return pb.Packet(activations=pb.Activations(mb=pb.MicroBatch(id=mb_id), hidden=hidden, targets=targets))


def frames(*packets: pb.Packet) -> list[pb.Frame]:
    return [f for i, p in enumerate(packets) for f in split_packet(p, i)]


HELLO = hello_packet("upstream", 0, "run", PROTOCOL_VERSION)
BAD_CASES = {
    "malformed packet": [pb.Frame(packet_id=9, data=b"\xff\xfe garbage", last=True, total_size=10)],
    "truncated": [pb.Frame(packet_id=9, data=b"\x12\x03ab", last=True, total_size=100)],
    "does not fit this stage": frames(activations(tensor_to_pb(torch.randn(B, T, CFG.d_model + 1), "fp32"))),
    "must be floating point": frames(
        activations(tensor_to_pb(torch.zeros(B, T, CFG.d_model, dtype=torch.int32), "raw"))
    ),
    "payload of": frames(
        activations(pb.Tensor(shape=[B, T, CFG.d_model], dtype=pb.FLOAT32, codec=pb.FP32, payload=b"\0" * 100))
    ),
    "unknown codec": frames(activations(pb.Tensor(shape=[B, T, CFG.d_model], dtype=pb.FLOAT32, codec=99))),
    "exceeds the limit": frames(activations(pb.Tensor(shape=[1 << 20, 1 << 20], dtype=pb.FLOAT32, codec=pb.FP32))),
    "a run that sends none": frames(
        pb.Packet(
            activations=pb.Activations(
                mb=pb.MicroBatch(id=1, samples=[0, 1]),
                hidden=tensor_to_pb(good_hidden(), "fp32"),
                cache=pb.CACHE_DELTA,
            )
        )
    ),
}


async def exchange(target: str, outgoing: list[pb.Frame]) -> tuple[list[pb.Packet], grpc.StatusCode, str]:
    """Send frames as the upstream neighbour; return the packets received and the call's final status."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = wgrpc.StageStub(channel).Link()
        reasm, replies = Reassembler(), []
        try:
            for frame in outgoing:
                await call.write(frame)
            while len(replies) < 2:
                frame = await asyncio.wait_for(call.read(), 30)
                if frame is grpc.aio.EOF:
                    break
                packet = reasm.push(frame)
                if packet is not None:
                    replies.append(packet)
            if len(replies) == 2:
                call.cancel()
                return replies, grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError:
            pass
        return replies, await asyncio.wait_for(call.code(), 30), await call.details()


async def with_peer(test, train: TrainConfig | None = None) -> None:
    """Run ``test(target, daemon)`` against a real daemon holding the last stage, with ``train``'s recipe."""
    daemon = PeerDaemon(peer_settings("last", device="cpu"))
    endpoint = await daemon.start_server()
    assignment = sealed_assignment(
        [(0, 1, [("upstream", "/ip4/127.0.0.1/tcp/1")]), (1, CFG.n_layers, [("last", "/ip4/127.0.0.1/tcp/2")])],
        model=model_to_pb(CFG),
        train=train_to_pb(train or TrainConfig(micro_batches=1, micro_batch_size=B)),
    )
    await daemon.session._on_assign(assignment)
    try:
        await test(multiaddr_to_grpc_target(endpoint), daemon)
    finally:
        await daemon.close()


async def expect_refusal(target: str, outgoing: list[pb.Frame], code: grpc.StatusCode, text: str) -> None:
    replies, got, details = await exchange(target, outgoing)
    assert got == code, (got, details)
    assert text in details, details
    assert all(r.WhichOneof("body") == "hello" for r in replies)


async def expect_served(target: str, mb_id: int) -> None:
    replies, code, details = await exchange(
        target, frames(HELLO, activations(tensor_to_pb(good_hidden(), "fp32"), mb_id))
    )
    assert code == grpc.StatusCode.OK and len(replies) == 2, (code, details)
    assert replies[0].WhichOneof("body") == "hello"
    reply = replies[1]
    assert reply.WhichOneof("body") == "gradients" and reply.gradients.mb.id == mb_id
    grad = tensor_from_pb(reply.gradients.grad)
    assert grad.shape == (B, T, CFG.d_model) and bool(torch.isfinite(grad).all())
    assert reply.gradients.loss_sum > 0 and reply.gradients.tokens == B * T


def test_bad_messages_get_invalid_argument_and_the_peer_keeps_serving() -> None:
    async def scenario(target: str, daemon: PeerDaemon) -> None:
        await expect_served(target, 1)
        for i, (text, bad) in enumerate(BAD_CASES.items()):
            await expect_refusal(target, frames(HELLO) + bad, grpc.StatusCode.INVALID_ARGUMENT, text)
            await expect_served(target, 100 + i)
        assert daemon.stage.refused >= len(BAD_CASES) - 1  # decode errors count too
        # NaN or implausible hidden states are not refused but dropped and counted: tests/test_sanity_wired.py

    asyncio.run(with_peer(scenario))


def test_wrong_protocol_and_strangers_are_refused() -> None:
    async def scenario(target: str, daemon: PeerDaemon) -> None:
        old = hello_packet("upstream", 0, "run", PROTOCOL_VERSION + 1)
        await expect_refusal(
            target, frames(old), grpc.StatusCode.FAILED_PRECONDITION, f"this peer speaks {PROTOCOL_VERSION}"
        )
        stranger = hello_packet("mallory", 0, "run", PROTOCOL_VERSION)
        await expect_refusal(target, frames(stranger), grpc.StatusCode.PERMISSION_DENIED, "not an upstream neighbour")
        other_run = hello_packet("upstream", 0, "another-run", PROTOCOL_VERSION)
        await expect_refusal(target, frames(other_run), grpc.StatusCode.FAILED_PRECONDITION, "is not this peer's run")
        big_first = activations(tensor_to_pb(good_hidden(), "fp32"))
        await expect_refusal(target, frames(big_first), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the limit of 4096")
        small_first = pb.Packet(gradients=pb.Gradients(mb=pb.MicroBatch(id=1)))
        await expect_refusal(target, frames(small_first), grpc.StatusCode.INVALID_ARGUMENT, "expected a hello")
        await expect_served(target, 7)

    asyncio.run(with_peer(scenario))
