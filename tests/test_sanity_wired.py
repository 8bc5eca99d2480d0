"""Sanity checks wired in: a live peer drops implausible tensors, quarantines their sender and reports it;
the coordinator excludes the reported peer and `ravn status` says why.

The peer is the real daemon behind its real gRPC server (the last stage of a 2-stage gpt-tiny, as in
test_bad_input); the coordinator half drives a real ``SwarmRun`` through its report handler.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from coordinator.run_settings import RunFailed, RunSettings
from coordinator.sessions import PeerSession
from coordinator.status_data import SwarmStatus
from coordinator.status_verdict import status_json
from coordinator.status_view import renderable
from coordinator.swarm_run import SwarmRun
from peer.daemon import PeerDaemon
from peer.faults import PoisonedPolicy, wire_policy
from swarm.config import MODEL_PRESETS, TrainConfig
from swarm.pb import control_pb2 as cpb
from swarm.pb import wire_pb2 as pb
from swarm.wire.packets import tensor_from_pb, tensor_to_pb
from swarm.wire.sanity import DAEMON_SETTINGS
from tests.test_bad_input import CFG, HELLO, B, T, activations, exchange, frames, with_peer


async def send(target: str, hidden: torch.Tensor, mb_id: int) -> pb.Gradients:
    replies, code, details = await exchange(
        target, frames(HELLO, activations(tensor_to_pb(hidden, "fp32", allow_nonfinite=True), mb_id))
    )
    assert len(replies) == 2 and replies[1].WhichOneof("body") == "gradients", (code, details, replies)
    return replies[1].gradients


def test_implausible_activations_are_dropped_counted_and_quarantine_their_sender() -> None:
    async def scenario(target: str, daemon: PeerDaemon) -> None:
        for i in range(DAEMON_SETTINGS.warmup):  # the link's norm statistics warm up on honest tensors
            g = await send(target, torch.randn(B, T, CFG.d_model), i + 1)
            assert not g.dropped and g.tokens == B * T
        nan = torch.randn(B, T, CFG.d_model)
        nan[0, 1, 2] = float("nan")
        bad = [torch.randn(B, T, CFG.d_model) * 1e4, nan, torch.randn(B, T, CFG.d_model) * 1e6]
        for k, hidden in enumerate(bad):  # z-score, NaN, magnitude: each dropped, the stream stays up
            g = await send(target, hidden, 100 + k)
            assert g.dropped and not g.HasField("grad"), g
        stats = daemon.session.stats()
        assert stats.rejected == 3 and dict(stats.rejected_by_sender) == {"upstream": 3}
        assert daemon.stage.refused == 0  # dropped, not refused: nothing waits for a micro-batch that never returns
        assert "quarantined after 3 rejected tensors" in daemon.stage.sanity.quarantine.reason("upstream")
        g = await send(target, torch.randn(B, T, CFG.d_model), 200)  # quarantined: even honest-looking ones
        assert g.dropped
        assert all(bool(torch.isfinite(p).all()) for p in daemon.stage.runner.model.parameters())
        daemon.metrics.update(daemon.session.stats())
        scrape = daemon.metrics_server.scrape()
        assert 'ravn_peer_rejected_tensors_by_sender_total{peer="last",sender="upstream"} 3.0' in scrape
        daemon.stage.sanity.forgive("upstream")  # an operator's decision: served again
        g = await send(target, torch.randn(B, T, CFG.d_model), 201)
        assert not g.dropped and bool(torch.isfinite(tensor_from_pb(g.grad)).all())

    asyncio.run(with_peer(scenario))


def test_the_poisoned_policy_corrupts_training_tensors_only_after_its_step() -> None:
    version = [0]
    policy = wire_policy("fp32", "fp32", "scale", 2, lambda: version[0])
    assert isinstance(policy, PoisonedPolicy)
    grad, mb = torch.ones(2, 3), pb.MicroBatch(id=1)
    assert tensor_from_pb(policy.gradients(mb, grad, to="upstream").gradients.grad).abs().max() == 1
    version[0] = 2
    assert tensor_from_pb(policy.gradients(mb, grad, to="upstream").gradients.grad).abs().max() == 1e6
    evalmb = pb.MicroBatch(id=2, eval=True)
    assert tensor_from_pb(policy.activations(evalmb, grad, None).activations.hidden).abs().max() == 1
    nan = wire_policy("fp32", "fp32", "nan", 0).activations(mb, grad, None).activations.hidden
    assert bool(torch.isnan(tensor_from_pb(nan)).all())
    assert type(wire_policy("fp32", "int8")) is not PoisonedPolicy
    with pytest.raises(ValueError, match="unknown poison mode"):
        wire_policy("fp32", "fp32", "flip")


def make_run(tmp_path: Path) -> SwarmRun:
    settings = RunSettings(
        name="excl",
        run_dir=tmp_path,
        model=MODEL_PRESETS["gpt-tiny"],
        train=TrainConfig(checkpoint_every=5),
        peers=3,
    )
    run = SwarmRun(settings, SimpleNamespace(s=SimpleNamespace(heartbeat=1.0)))
    for i, name in enumerate(["p0", "p1", "p2"]):
        run.planning.planned[name] = (i, i + 1, f"/ip4/127.0.0.1/tcp/{1000 + i}")
        run.sessions.peers[name] = PeerSession(name, run.planning.planned[name][2], "cpu", 0, stage=i)
    run.flow.started = True
    return run


def test_a_reported_peer_is_excluded_for_the_rest_of_the_run_and_status_says_why(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    evil = "gradients: norm 1e+03 is 40.0 deviations above\n\x1b[2J this link's running log-norm"
    report = cpb.StatusReport(peer_id="p0", quarantined=[cpb.Quarantined(peer_id="p1", reason=evil)])
    run.reports.on_report(report)
    run.reports.on_report(report)  # reported again with every report: acted on once
    why = run.sessions.excluded["p1"]
    assert "40.0 deviations" in why and "(reported by p0)" in why and "\n" not in why and "\x1b" not in why
    commands = run.sessions.peers["p1"].commands
    assert commands.qsize() == 1 and commands.get_nowait().shutdown.reason.startswith("excluded: ")
    assert "p1" in run.sessions.lost and run.flow.failed.is_set() and "peer p1 excluded" in run.flow.failure
    # the recovery path treats it as departed; it can neither dial in again nor be re-admitted as a join
    with pytest.raises(PermissionError, match="excluded from this run"):
        run.sessions.register(cpb.JoinRequest(peer_id="p1", endpoint=run.planning.planned["p1"][2]))
    run.sessions.peers.pop("p1")
    run.planning.planned.pop("p1")
    run.sessions.lost.discard("p1")
    record = SimpleNamespace(peer_id="p1", state="joining")  # not a full record: planning with it would raise
    run.roster.consider_joins({"p1": record})
    assert "p1" not in run.roster.considered and not run.roster.joiners
    # a report about itself or about a peer not in the run changes nothing
    run.reports.on_report(cpb.StatusReport(peer_id="p2", quarantined=[cpb.Quarantined(peer_id="p2", reason="x")]))
    run.reports.on_report(cpb.StatusReport(peer_id="p2", quarantined=[cpb.Quarantined(peer_id="nobody", reason="x")]))
    assert set(run.sessions.excluded) == {"p1"}

    status = run.status()
    assert [(e.name, e.reason) for e in status.excluded] == [("p1", why)]
    doc = status_json(status)
    assert doc["excluded"] == [{"name": "p1", "reason": why}]
    back = SwarmStatus.from_dict(json.loads(json.dumps(doc)))
    assert back.excluded == status.excluded
    console = Console(width=200, record=True)
    console.print(renderable(back))
    text = console.export_text()
    assert "excluded peers" in text and "p1" in text and "reported by p0" in text
    run.record.artifacts.close()
    assert any(json.loads(line)["kind"] == "exclude" for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_without_checkpoints_an_exclusion_fails_the_run_with_the_reason(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    run.s.train = TrainConfig(checkpoint_every=0)

    async def wait() -> None:
        run.reports.on_report(cpb.StatusReport(peer_id="p2", quarantined=[cpb.Quarantined(peer_id="p1", reason="NaN")]))
        await run.flow.wait(asyncio.Event(), 5, "nothing")

    with pytest.raises(RunFailed, match="peer p1 excluded: NaN"):
        asyncio.run(wait())
    run.record.artifacts.close()
