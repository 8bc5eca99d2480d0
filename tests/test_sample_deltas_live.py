"""A live peer takes activation deltas from its upstream link, drops what it cannot rebuild, refuses lies.

The real daemon with its real gRPC server on loopback holds the last stage of a 2-stage gpt-tiny; the test
dials its Stage.Link as the upstream neighbour would, at lr 0 so every loss is comparable.
"""

import asyncio
import math
from pathlib import Path

import grpc
import pytest
import torch

from peer.daemon import PeerDaemon
from swarm.config import MODEL_PRESETS, PROTOCOL_VERSION, TrainConfig
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.wire.packets import Reassembler, split_packet, tensor_to_pb
from swarm.wire.transport import hello_packet
from tests.conftest import read_metrics, run_ravn_local
from tests.test_bad_input import with_peer

CFG = MODEL_PRESETS["gpt-tiny"]
B, T = 2, 16
HELLO = hello_packet("upstream", 0, "run", PROTOCOL_VERSION)
TRAIN = TrainConfig(
    micro_batches=1,
    micro_batch_size=B,
    lr=0.0,
    train_samples=8,
    wire_forward_delta="int4_rot",
    delta_cache_bytes=2 * T * CFG.d_model * 2,  # room for 2 samples' rows
)
X0 = torch.randn(B, T, CFG.d_model, generator=torch.Generator().manual_seed(0))
TARGETS = tensor_to_pb(torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1)).short(), "raw")


def act(mb_id: int, hidden: torch.Tensor, cache: int = pb.CACHE_NONE, samples=(0, 1)) -> pb.Packet:
    mb = pb.MicroBatch(id=mb_id, samples=list(samples) if cache != pb.CACHE_NONE else [])
    return pb.Packet(
        activations=pb.Activations(mb=mb, hidden=tensor_to_pb(hidden, "fp32"), targets=TARGETS, cache=cache)
    )


async def stream(target: str, *packets: pb.Packet) -> tuple[list[pb.Gradients], grpc.StatusCode, str]:
    """Send ``packets`` after a hello on one link; the gradients that come back, and how the call ended."""
    frames = [f for i, p in enumerate((HELLO, *packets)) for f in split_packet(p, i)]
    async with grpc.aio.insecure_channel(target) as channel:
        call = wgrpc.StageStub(channel).Link()
        reasm, got = Reassembler(), []
        try:
            for frame in frames:
                await call.write(frame)
            while len(got) < len(packets):
                frame = await asyncio.wait_for(call.read(), 30)
                if frame is grpc.aio.EOF:
                    break
                packet = reasm.push(frame)
                if packet is not None and packet.WhichOneof("body") == "gradients":
                    got.append(packet.gradients)
            if len(got) == len(packets):
                call.cancel()
                return got, grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError:
            pass
        return got, await asyncio.wait_for(call.code(), 30), await call.details()


def test_a_delta_rebuilds_the_rows_kept_and_a_new_link_starts_empty() -> None:
    async def scenario(target: str, daemon: PeerDaemon) -> None:
        kept = X0.bfloat16().float()
        got, code, details = await stream(
            target,
            act(1, X0, pb.CACHE_STORE),
            act(2, torch.zeros_like(X0), pb.CACHE_DELTA),  # no change: the rows kept, as kept (bf16)
            act(3, kept),  # the same rows sent whole
            act(4, X0 - kept, pb.CACHE_DELTA),  # the change back to X0 itself
        )
        assert code == grpc.StatusCode.OK and len(got) == 4, details
        assert not any(g.dropped for g in got)
        assert got[1].loss_sum == got[2].loss_sum and got[0].loss_sum == got[3].loss_sum
        assert got[0].loss_sum != got[1].loss_sum
        # a new link: this side holds nothing of the old one's rows, so a delta is dropped and the link serves on
        got, code, details = await stream(target, act(5, torch.zeros_like(X0), pb.CACHE_DELTA), act(6, X0))
        assert code == grpc.StatusCode.OK and [g.dropped for g in got] == [True, False], details
        assert daemon.stage.refused == 0

    asyncio.run(with_peer(scenario, TRAIN))


def test_a_sender_that_lies_about_its_rows_is_refused() -> None:
    async def scenario(target: str, daemon: PeerDaemon) -> None:
        for packets, text in (
            ((act(1, X0, pb.CACHE_STORE, samples=[0]),), "1 sample indices for a micro-batch of 2 rows"),
            ((act(1, X0, pb.CACHE_STORE), act(2, X0, pb.CACHE_STORE, samples=[2, 3])), "beyond the agreed room"),
            ((act(1, X0, 9),), "unknown cache mode"),
        ):
            _, code, details = await stream(target, *packets)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and text in details, (code, details)
        got, code, _ = await stream(target, act(7, X0))  # and it keeps serving
        assert code == grpc.StatusCode.OK and not got[0].dropped

    asyncio.run(with_peer(scenario, TRAIN))


@pytest.mark.slow  # three peer processes train a few steps: over 20 s on a shared machine
def test_a_swarm_sends_returning_samples_as_deltas(tmp_path: Path) -> None:
    """``ravn local --train-samples 16 --wire-forward-delta int4_rot``: real peers, one epoch a step, every row
    kept on disk."""
    run_ravn_local(
        tmp_path,
        "aq",
        *("--peers", "3", "--model", "gpt-tiny", "--steps", "6", "--eval-every", "0", "--eval-batches", "1"),
        *(
            "--train-samples",
            "16",
            "--wire-forward-delta",
            "int4_rot",
            "--delta-cache-mib",
            "0",
            "--delta-spill-mib",
            "1",
        ),
    )
    summary = next(m for m in read_metrics(tmp_path / "aq") if m["kind"] == "summary")
    assert summary["steps"] == 6 and math.isfinite(summary["final_val_loss"])
    for stage in summary["stages"][:2]:  # step 0 stores every sample (4 micro-batches), steps 1-5 send deltas
        forward = {k: v for k, v in stage["sent_codecs"].items() if k.startswith("forward:")}
        assert forward == {"forward:int8": 4 + 1, "forward:delta:int4_rot": 20}, stage  # + the validation's one
        assert stage["dropped"] == 0
    held = [s["delta_rows"] for s in summary["stages"]]  # each end of each link keeps the 16 samples' rows
    assert held == [{"held": n, "spilled": n} for n in (16, 32, 16)], held
