"""Who may call the coordinator in a peer's name, and what it may upload: the real ControlService and
SwarmRun behind the real ServerAuth on loopback; members and an impersonator with their own keys."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch

from coordinator.call_checks import CHECKPOINT_LEAD, checkpoint_window
from coordinator.control_service import ControlService
from coordinator.run_settings import RunSettings
from coordinator.sessions import PeerSession
from coordinator.swarm_run import SwarmRun
from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.dht.signing import new_key
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.security import auth
from swarm.security.identity import public_key_text
from swarm.train.model import StageModel
from swarm.wire.packets import split_packet, tensor_to_pb

TOKEN = auth.generate_token()
CFG = MODEL_PRESETS["gpt-tiny"]
KEYS = {name: new_key() for name in ("p0", "p1", "p2")}
MALLORY = new_key()  # holds the token, but none of the members' keys


def make_run(tmp_path: Path) -> SwarmRun:
    settings = RunSettings(
        name="calls", run_dir=tmp_path, model=CFG, train=TrainConfig(steps=100, checkpoint_every=5), peers=3,
        swarm_token=TOKEN,
    )  # fmt: skip
    run = SwarmRun(settings, SimpleNamespace(s=SimpleNamespace(heartbeat=1.0)))
    for i, name in enumerate(KEYS):
        run.planning.planned[name] = (i, i + 1, f"/ip4/127.0.0.1/tcp/{1000 + i}")
        run.sessions.peers[name] = PeerSession(name, run.planning.planned[name][2], "cpu", 0, stage=i)
        run.planning.public_keys[name] = public_key_text(KEYS[name])
    run.flow.started = True
    run.record.last_step = 9
    return run


def chunk(peer: str, stage: int, start: int, end: int, version: int, *, periodic: bool = True) -> cpb.StateChunk:
    c = cpb.StateChunk(peer_id=peer, stage=stage, version=version, layer_start=start, layer_end=end, periodic=periodic)
    for name, t in StageModel(CFG, start, end).state_dict().items():
        c.tensors.add(name=name, tensor=tensor_to_pb(torch.full_like(t, 7.0), "fp32"))
    return c


async def code_of(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


class Caller:
    """A channel whose proofs name ``peer`` and are signed with ``key``."""

    def __init__(self, target: str, peer: str, key) -> None:
        ics = auth.client_interceptors(TOKEN, peer, auth.COORDINATOR_AUDIENCE, signer=key)
        self.channel = grpc.aio.insecure_channel(target, interceptors=ics)
        self.stub = cgrpc.ControlStub(self.channel)

    def upload(self, c: cpb.StateChunk):
        return self.stub.UploadState(iter(split_packet(c, c.version or 1)), timeout=20)


def test_calls_naming_a_peer_are_served_only_to_that_peer_and_uploads_only_for_its_block(tmp_path: Path) -> None:
    run = make_run(tmp_path)

    async def scenario() -> dict[str, grpc.StatusCode]:
        verifier = auth.Verifier(TOKEN, audiences=[auth.COORDINATOR_AUDIENCE], keys=run.planning.peer_key)
        server = grpc.aio.server(interceptors=[auth.ServerAuth(verifier)])
        cgrpc.add_ControlServicer_to_server(ControlService(run.control_handlers()), server)
        target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        p0, mallory_as_p0 = Caller(target, "p0", KEYS["p0"]), Caller(target, "p0", MALLORY)
        mallory_as_p1, mallory = Caller(target, "p1", MALLORY), Caller(target, "mallory", MALLORY)
        codes = {}
        try:
            codes["impostor uploads p1's block"] = await code_of(mallory_as_p1.upload(chunk("p1", 1, 1, 2, 10**6)))
            codes["impostor names p1 in the body"] = await code_of(mallory.upload(chunk("p1", 1, 1, 2, 10)))
            codes["p0 names p1 in the body"] = await code_of(p0.upload(chunk("p1", 1, 1, 2, 10)))
            codes["p0 uploads p1's layers"] = await code_of(p0.upload(chunk("p0", 0, 1, 2, 10)))
            codes["p0 claims p1's stage"] = await code_of(p0.upload(chunk("p0", 1, 0, 1, 10, periodic=False)))
            codes["p0 at a fake high version"] = await code_of(p0.upload(chunk("p0", 0, 0, 1, 10**6)))
            codes["p0 before the restore point"] = await code_of(p0.upload(chunk("p0", 0, 0, 1, 0)))
            run.planning.restore_version = 5
            codes["p0 older than the restore point"] = await code_of(p0.upload(chunk("p0", 0, 0, 1, 4)))
            accusation = cpb.StatusReport(peer_id="p0", quarantined=[cpb.Quarantined(peer_id="p1", reason="x")])
            codes["impostor reports as p0"] = await code_of(mallory_as_p0.stub.Report(accusation, timeout=10))
            codes["impostor reports, naming p0"] = await code_of(mallory.stub.Report(accusation, timeout=10))
            fetch = cpb.FetchStateRequest(peer_id="p0", version=10)
            codes["impostor fetches as p0"] = await code_of(mallory_as_p0.stub.FetchState(fetch, timeout=10).read())
            join = cpb.JoinRequest(peer_id="p0", endpoint=run.planning.planned["p0"][2])
            codes["impostor joins as p0"] = await code_of(mallory_as_p0.stub.Join(join, timeout=10).read())
            # only p0's own v0
            assert run.store.versions() == [0] and not run.record.states and not run.sessions.excluded
            codes["p0 uploads its checkpoint"] = await code_of(p0.upload(chunk("p0", 0, 0, 1, 10)))
            codes["p0 uploads its final block"] = await code_of(p0.upload(chunk("p0", 0, 0, 1, 0, periodic=False)))
            codes["p0 reports"] = await code_of(p0.stub.Report(cpb.StatusReport(peer_id="p0"), timeout=10))
            codes["status needs no identity"] = await code_of(mallory.stub.Status(cpb.StatusRequest(), timeout=10))
        finally:
            for c in (p0, mallory_as_p0, mallory_as_p1, mallory):
                await c.channel.close()
            await server.stop(None)
        return codes

    codes = asyncio.run(asyncio.wait_for(scenario(), 60))
    denied, invalid, ok = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK
    assert codes == {
        "impostor uploads p1's block": denied,
        "impostor names p1 in the body": denied,
        "p0 names p1 in the body": denied,
        "p0 uploads p1's layers": denied,
        "p0 claims p1's stage": denied,
        "p0 at a fake high version": invalid,
        "p0 before the restore point": ok,  # restore point 0: a checkpoint at the start is expected
        "p0 older than the restore point": invalid,
        "impostor reports as p0": denied,
        "impostor reports, naming p0": denied,
        "impostor fetches as p0": denied,
        "impostor joins as p0": denied,
        "p0 uploads its checkpoint": ok,
        "p0 uploads its final block": ok,
        "p0 reports": ok,
        "status needs no identity": ok,
    }
    assert run.store.versions() == [0, 10] and set(run.record.states) == {0} and not run.sessions.excluded


def test_the_checkpoint_window_follows_the_run() -> None:
    assert checkpoint_window(0, -1, 100, 5, 0) == (0, 5 + CHECKPOINT_LEAD)
    assert checkpoint_window(20, 9, 100, 5, 2) == (20, 20 + 5 + 2 + CHECKPOINT_LEAD)  # restored past the reports
    assert checkpoint_window(0, 90, 100, 5, 0) == (0, 100)  # never past the run's steps
    assert checkpoint_window(0, 9, 10**9, 5, 0)[1] == 10 + 5 + CHECKPOINT_LEAD  # far below a forged 10**6
