"""Plan epochs wired in: the coordinator refuses checkpoints of a plan it has left, a peer stops uploading
the work of an assignment it no longer holds, and on real processes a restore after two failures under
two different splits loads exactly one timeline's checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from safetensors import safe_open

from coordinator.run_settings import RunSettings
from coordinator.sessions import PeerSession
from coordinator.swarm_run import SwarmRun
from peer.checkpoints import Checkpoints
from peer.compute import ComputeWorker
from peer.faults import Faults
from peer.stage import Stage
from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.train.checkpoint import state_digest
from swarm.train.model import StageModel
from swarm.wire.packets import split_packet, tensor_to_pb
from tests.conftest import ravn_cmd
from tests.swarm_procs import Proc, assert_all_gone
from tests.test_recovery import peer_pid


def chunk(epoch: int, version: int) -> cpb.StateChunk:
    """The whole of gpt-tiny as one block's checkpoint (the coordinator checks it against the block)."""
    c = cpb.StateChunk(peer_id="p0", version=version, layer_start=0, layer_end=3, periodic=True, epoch=epoch)
    for name, t in StageModel(MODEL_PRESETS["gpt-tiny"], 0, 3).state_dict().items():
        c.tensors.add(name=name, tensor=tensor_to_pb(t, "fp32"))
    return c


def test_the_coordinator_refuses_a_checkpoint_of_a_plan_it_has_left(tmp_path: Path) -> None:
    settings = RunSettings(
        name="epochs", run_dir=tmp_path, model=MODEL_PRESETS["gpt-tiny"], train=TrainConfig(checkpoint_every=5), peers=1
    )
    run = SwarmRun(settings, SimpleNamespace(s=SimpleNamespace(heartbeat=1.0)))
    run.sessions.peers["p0"] = PeerSession("p0", "/ip4/127.0.0.1/tcp/1", "cpu", 0, stage=0)
    run.planning.planned["p0"] = (0, 3, "/ip4/127.0.0.1/tcp/1")  # p0 holds the whole model, so its uploads are its own

    async def scenario() -> None:
        port = await run.start_server()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = cgrpc.ControlStub(channel)

                async def upload(c: cpb.StateChunk):
                    async def frames():
                        for frame in split_packet(c, c.version):
                            yield frame

                    return await stub.UploadState(frames(), timeout=30)

                old = run.store.begin_epoch(0)
                await upload(chunk(old, 5))
                assert run.store.latest_complete() == 5
                run.store.begin_epoch(5)  # a recovery from v5
                for epoch in (old, old + 7):
                    try:
                        await upload(chunk(epoch, 10))
                        raise AssertionError(f"an upload of epoch {epoch} was accepted")
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
                        assert f"plan epoch {epoch}" in e.details()
                assert run.store.versions() == [5]
        finally:
            await run.stop_server()

    asyncio.run(scenario())


class RecordingControl:
    def __init__(self) -> None:
        self.uploads = 0

    async def UploadState(self, frames, timeout=None):  # noqa: N802 - the stub's name
        async for _ in frames:
            pass
        self.uploads += 1
        return cpb.UploadReply()


def test_a_peer_drops_a_checkpoint_taken_under_an_assignment_it_no_longer_holds() -> None:
    """The step that took a snapshot finishes after a re-plan closed its Stage: nothing is uploaded."""

    async def scenario() -> None:
        control = RecordingControl()
        compute = ComputeWorker()
        checkpoints = Checkpoints("p0", lambda: control, lambda: True, Faults())
        tasks: list[asyncio.Task] = []
        stage = SimpleNamespace(
            closed=False,
            number=0,
            hooks=SimpleNamespace(compute=compute, checkpoint=checkpoints.on_snapshot),
            runner=SimpleNamespace(pending_checkpoint=None),
            stepped=asyncio.Event(),
            assignment=cpb.Assignment(epoch=1),
            view=SimpleNamespace(stage=0, layers=(0, 3)),
            spawn=lambda coro, name: tasks.append(asyncio.ensure_future(coro)) or tasks[-1],
        )
        try:
            snapshot = (5, {"layers.0.w": torch.ones(4)}, {})

            def step_then_reassigned() -> None:  # the step that took the snapshot finishes after a re-plan
                stage.runner.pending_checkpoint = snapshot
                stage.closed = True

            await Stage.compute(stage, step_then_reassigned)
            await asyncio.gather(*tasks)
            assert control.uploads == 0 and stage.runner.pending_checkpoint is None

            stage.closed = False  # the same step, while the assignment stands
            stage.runner.pending_checkpoint = snapshot
            await Stage.compute(stage, lambda: None)
            await asyncio.gather(*tasks)
            assert control.uploads == 1
        finally:
            await asyncio.to_thread(compute.close)

    asyncio.run(scenario())


C = 5


def new_blocks(root: Path, version: int, blocks: list[tuple[int, int]], timeout: float) -> list[Path]:
    """The files of these blocks at ``version`` once all have arrived (one each, whatever the layout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [sorted((root / f"v{version:08d}").rglob(f"layers-{a}-{b}.safetensors")) for a, b in blocks]
        if all(len(f) == 1 for f in found):
            return [f[0] for f in found]
        time.sleep(0.05)
    raise AssertionError(f"blocks {blocks} of v{version} did not arrive within {timeout} s: {sorted(root.rglob('*'))}")


@pytest.mark.slow  # a whole swarm for over 20 s: keeps the default suite under 10 minutes
def test_a_restore_after_two_failures_under_two_splits_loads_one_timelines_checkpoint(tmp_path: Path) -> None:
    """3 peers split 6 layers; the first stage's holder dies instead of uploading v5 (its neighbours
    uploaded theirs), the 2 survivors re-plan with another split and replay to v5; one of them is then
    killed before v10, and the last peer restores v5: its state must be the second timeline's v5, byte
    for byte, with no layer of the dead first plan."""
    proc = Proc(
        ravn_cmd(
            "local",
            "--runs-dir",
            str(tmp_path),
            "--name",
            "epochs",
            "--peers",
            "3",
            "--steps",
            "60",
            "--checkpoint-every",
            str(C),
            "--eval-every",
            "0",
            "--eval-batches",
            "1",
            "--heartbeat",
            "1",
            "--micro-batches",
            "2",
            "--micro-batch-size",
            "2",
            "--debug-crash-at-checkpoint",
            f"0={C}",
        )
    )
    run_dir = tmp_path / "epochs"
    pids: list[int] = []
    try:
        _, first = proc.wait_for(r"^plan: (.*)$", 180)
        pids = proc.tree()
        old = {p: (int(a), int(b)) for p, a, b in re.findall(r"(\S+)=layers\[(\d+),(\d+)\)", first.group(1))}
        victim = next(p for p, (a, _) in old.items() if a == 0)
        _, second = proc.wait_for(rf"recovered without {victim}: plan (.*); resuming from step (\d+)", 120)
        assert second.group(2) == "0", proc.output  # v5 never completed: the first plan's work is redone
        new = {p: (int(a), int(b)) for p, a, b in re.findall(r"(\S+)=layers\[(\d+),(\d+)\)", second.group(1))}
        assert len(old) == 3 and len(new) == 2, (old, new)
        truth = new_blocks(run_dir / "checkpoints", C, sorted(new.values()), 120)
        killed, last = sorted(new)
        os.kill(peer_pid(proc, killed), signal.SIGKILL)  # before v10: the restore point is v5
        proc.wait_for(rf"recovered without {killed}: plan {last}=layers\[0,6\); resuming from step {C} ", 120)
        log = run_dir / "logs" / f"{last}.log"
        deadline = time.monotonic() + 60
        pattern = rf"restored \d+ tensors at weight version {C} \(state digest (\w+)\)"
        while not (found := re.search(pattern, log.read_text())):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        weights: dict[str, torch.Tensor] = {}
        optim: dict[str, torch.Tensor] = {}
        for path in truth:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    kind, _, name = key.partition("/")
                    (weights if kind == "w" else optim)[name] = f.get_tensor(key)
        assert found.group(1) == state_digest(weights, optim), "the restored state is not the second plan's v5"
    finally:
        pids += proc.tree()
        for pid in pids:  # what it trains after the restore is not this test's business: stop at once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)
    assert_all_gone(pids)
