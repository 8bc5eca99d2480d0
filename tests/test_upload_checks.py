"""Issue 16 items 2 (tensor checks) and 6: the coordinator checks every upload against the block it names.

A real coordinator gRPC server (``SwarmRun.start_server``: auth and limit interceptors on) on loopback,
called by a token holder as the peer ``p1`` that holds layers [1, 2) of gpt-tiny. Every bad upload is
INVALID_ARGUMENT and leaves the checkpoint store untouched; a good one is filed.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from coordinator.run_settings import RunSettings
from coordinator.sessions import PeerSession
from coordinator.swarm_run import SwarmRun
from coordinator.upload_checks import gpt_block_spec
from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.dht.signing import new_key
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.pb import wire_pb2 as pb
from swarm.security import auth
from swarm.security.identity import public_key_text
from swarm.train.model import StageModel
from swarm.wire.packets import split_packet, tensor_to_pb

CFG = MODEL_PRESETS["gpt-tiny"]
TOKEN = auth.generate_token()
KEYS = {"p0": new_key(), "p1": new_key()}  # each member's record key, pinned in the plan


def make_run(tmp_path: Path) -> SwarmRun:
    settings = RunSettings(
        name="up", run_dir=tmp_path, model=CFG, train=TrainConfig(checkpoint_every=5), peers=2, swarm_token=TOKEN
    )
    run = SwarmRun(settings, SimpleNamespace(s=SimpleNamespace(heartbeat=1.0)))
    for i, (name, block) in enumerate({"p0": (0, 1), "p1": (1, CFG.n_layers)}.items()):
        run.planning.planned[name] = (*block, f"/ip4/127.0.0.1/tcp/{1000 + i}")
        run.sessions.peers[name] = PeerSession(name, run.planning.planned[name][2], "cpu", 0, stage=i)
        run.planning.public_keys[name] = public_key_text(KEYS[name])
    run.flow.started = True
    run.record.last_step = 5
    return run


def good_chunk(version: int = 5) -> cpb.StateChunk:
    chunk = cpb.StateChunk(peer_id="p1", stage=1, version=version, layer_start=1, layer_end=CFG.n_layers, periodic=True)
    for name, t in StageModel(CFG, 1, CFG.n_layers).state_dict().items():
        chunk.tensors.add(name=name, tensor=tensor_to_pb(t, "fp32"))
        chunk.optimizer.add(name=f"{name}::exp_avg", tensor=tensor_to_pb(torch.zeros_like(t), "fp32"))
        chunk.optimizer.add(name=f"{name}::exp_avg_sq", tensor=tensor_to_pb(torch.zeros_like(t), "fp32"))
        chunk.optimizer.add(name=f"{name}::step", tensor=tensor_to_pb(torch.tensor(5.0), "fp32"))
    return chunk


def bad_chunks() -> dict[str, cpb.StateChunk]:
    out = {}
    c = good_chunk()
    c.tensors[0].tensor.CopyFrom(tensor_to_pb(torch.zeros(3, 3), "fp32"))
    out["does not match the expected"] = c
    c = good_chunk()
    nan = torch.full(tuple(c.tensors[1].tensor.shape), float("nan"))
    c.tensors[1].tensor.CopyFrom(tensor_to_pb(nan, "fp32", allow_nonfinite=True))
    out["NaN or Inf"] = c
    c = good_chunk()
    c.tensors.add(name="layers.0.attn.qkv.weight", tensor=tensor_to_pb(torch.zeros(192, 64), "fp32"))
    out["not part of this block"] = c  # a layer this block does not hold
    c = good_chunk()
    del c.tensors[-1]
    out["lacks 1 parameter"] = c
    c = good_chunk()
    c.optimizer.add(name="tok_emb.weight::exp_avg", tensor=tensor_to_pb(torch.zeros(2), "fp32"))
    out["does not belong"] = c
    c = good_chunk()
    shape = tuple(c.tensors[0].tensor.shape)
    c.tensors[0].tensor.CopyFrom(tensor_to_pb(torch.zeros(shape, dtype=torch.int32), "raw"))
    out["dtype"] = c
    return out


@contextlib.asynccontextmanager
async def coordinator(tmp_path: Path):
    run = make_run(tmp_path)
    port = await run.start_server()
    interceptors = auth.client_interceptors(TOKEN, "p1", auth.COORDINATOR_AUDIENCE, signer=KEYS["p1"])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=interceptors) as channel:
            yield run, cgrpc.ControlStub(channel)
    finally:
        await run._server.stop(None)


async def upload(stub: cgrpc.ControlStub, chunk: cpb.StateChunk) -> tuple[grpc.StatusCode, str]:
    async def frames():
        for f in split_packet(chunk, 1):
            yield f

    try:
        await stub.UploadState(frames(), timeout=30)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_the_spec_is_the_blocks_own_state() -> None:
    spec = gpt_block_spec(CFG, 1, CFG.n_layers)
    real = StageModel(CFG, 1, CFG.n_layers).state_dict()
    assert spec.shapes == {k: tuple(v.shape) for k, v in real.items()}
    assert spec.max_state_bytes < 4 * good_chunk().ByteSize()


@pytest.mark.parametrize("reason", list(bad_chunks()))
def test_a_bad_upload_is_refused_and_leaves_the_store_untouched(tmp_path: Path, reason: str) -> None:
    async def main() -> None:
        async with coordinator(tmp_path) as (run, stub):
            code, details = await upload(stub, bad_chunks()[reason])
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert reason in details, details
            assert run.store.versions() == []
            assert await upload(stub, good_chunk()) == (grpc.StatusCode.OK, "")
            assert run.store.versions() == [5]

    asyncio.run(main())


def test_an_upload_larger_than_any_block_is_refused_at_its_first_frame(tmp_path: Path) -> None:
    """Before: up to 8 GiB were buffered and every tensor decoded with a 2^31-element limit."""

    async def main() -> None:
        async with coordinator(tmp_path) as (run, stub):
            call = stub.UploadState(timeout=30)
            with contextlib.suppress(Exception):  # the coordinator may end the call while we write
                await call.write(pb.Frame(packet_id=1, data=bytes(1 << 20), total_size=200 << 20))
            # neither more data nor a half-close: a bounded coordinator refuses now, an unbounded one waits
            code = await asyncio.wait_for(call.code(), 5.0)
            details = await call.details()
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert "exceeds the limit" in details
            assert run.store.versions() == []

    asyncio.run(main())
