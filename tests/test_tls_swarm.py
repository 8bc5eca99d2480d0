"""TLS wired in, on real processes: peers serve their stage over TLS with self-signed certificates, the
fingerprints travel in their DHT records and the signed plan, the dialling neighbour pins them, and the
swarm trains. A dialler with the wrong pin, or in clear, is refused by the same live peer. The same for the
coordinator's Control service: its fingerprint rides in every signed plan, peers pin it, `ravn status`
pins the one `serve` prints."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from swarm.dht.multiaddrs import multiaddr_to_grpc_target
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.security import tls
from tests.conftest import ROOT, ravn_cmd, read_metrics
from tests.swarm_procs import assert_all_gone, coordinator, join_args, peer


async def refusals(target: str, presented: str) -> None:
    assert tls.fingerprint(await tls.fetch_certificate(target)) == presented
    with pytest.raises(tls.TlsError, match="was expected"):
        await tls.dial_pinned(target, tls.generate_self_signed().fingerprint)
    async with grpc.aio.insecure_channel(target) as channel:  # cleartext never reaches the handler
        call = wgrpc.StageStub(channel).Link()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.write(pb.Frame(packet_id=0, last=True))
            await call.read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow  # the default suite's TLS/restart test covers the same path; this one adds a variant
def test_a_tls_swarm_trains_with_pinned_links_and_refuses_a_wrong_pin(tmp_path: Path) -> None:
    coord = coordinator(
        tmp_path,
        "--peers",
        "2",
        "--heartbeat",
        "1",
        "--steps",
        "60",
        "--eval-every",
        "30",
        "--eval-batches",
        "2",
        "--name",
        "tls",
        "--model",
        "gpt-tiny",
    )
    procs = [coord]
    try:
        join = join_args(coord)
        for name in ("a", "b"):
            procs.append(peer(tmp_path, join, name, "--heartbeat", "1", "--threads", "1", "--tls", "self-signed"))
        served = {}
        for p in procs[1:]:
            _, m = p.wait_for(r"stage service listening on (\S+) over TLS, certificate (sha256:[0-9a-f]{64})", 120)
            served[m.group(2)] = multiaddr_to_grpc_target(m.group(1))
        coord.wait_for(r"^step \d+/60", 180)
        dialler = next(p for p in procs[1:] if "over TLS, certificate pinned" in p.output)
        _, pinned = dialler.wait_for(r"linking to \S+ over TLS, certificate pinned to (sha256:[0-9a-f]{64})", 1)
        assert pinned.group(1) in served  # the dialler pinned exactly what its neighbour serves
        asyncio.run(asyncio.wait_for(refusals(served[pinned.group(1)], pinned.group(1)), 30))
        assert coord.wait(300) == 0, coord.output
        tree = [pid for p in procs for pid in p.tree()]
    finally:
        for p in procs:
            p.stop()
    assert_all_gone(tree)
    metrics = read_metrics(tmp_path / "tls")
    evals = [m["loss"] for m in metrics if m["kind"] == "eval"]
    assert len(evals) == 2 and evals[-1] < evals[0] < 5.6


async def control_refusals(target: str, presented: str) -> None:
    assert tls.fingerprint(await tls.fetch_certificate(target)) == presented
    with pytest.raises(tls.TlsError, match="was expected"):
        await tls.dial_pinned(target, tls.generate_self_signed().fingerprint)
    async with grpc.aio.insecure_channel(target) as channel:  # cleartext never reaches the handler
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await cgrpc.ControlStub(channel).Status(cpb.StatusRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def ravn_status(target: str, token: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAVN_SWARM_TOKEN": token}
    cmd = ravn_cmd("status", "--coordinator", target, "--timeout", "10", *args)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.slow  # a whole swarm for over 20 s: keeps the default suite under 10 minutes
def test_a_tls_coordinator_is_pinned_by_its_peers_and_by_ravn_status(tmp_path: Path) -> None:
    coord = coordinator(
        tmp_path,
        "--peers",
        "2",
        "--heartbeat",
        "1",
        "--steps",
        "30",
        "--eval-every",
        "15",
        "--eval-batches",
        "2",
        "--name",
        "ctls",
        "--model",
        "gpt-tiny",
        "--tls",
        "self-signed",
    )
    procs = [coord]
    try:
        _, m = coord.wait_for(r"ravn status --coordinator (\S+) --tls-fingerprint (sha256:[0-9a-f]{64})", 60)
        target, fp = m.group(1), m.group(2)
        cert, key = (tmp_path / "ravn.coordinator.tls-cert.pem", tmp_path / "ravn.coordinator.tls-key.pem")
        assert tls.load_identity(cert, key).fingerprint == fp  # kept next to the signing key for a restart
        join = join_args(coord)
        token = join[join.index("--swarm-token") + 1]
        # While it waits for its peers: the printed pin works, anything else is refused with a reason.
        asyncio.run(asyncio.wait_for(control_refusals(target, fp), 30))
        ok = ravn_status(target, token, "--tls-fingerprint", fp, "--json")
        assert ok.returncode in (0, 1, 2) and json.loads(ok.stdout)["run"], ok.stderr  # 3: could not read it
        clear = ravn_status(target, token)
        assert clear.returncode == 3 and "it serves TLS; pass --tls-fingerprint" in clear.stderr, clear.stderr
        assert len(clear.stderr.strip().splitlines()) == 1, clear.stderr
        wrong = ravn_status(target, token, "--tls-fingerprint", tls.generate_self_signed().fingerprint)
        assert wrong.returncode == 3 and "was expected" in wrong.stderr, wrong.stderr
        for name in ("a", "b"):
            procs.append(peer(tmp_path, join, name, "--heartbeat", "1", "--threads", "1", "--tls", "self-signed"))
        for p in procs[1:]:
            _, pinned = p.wait_for(r"joining the coordinator at \S+ over TLS, certificate pinned to (\S+)", 120)
            assert pinned.group(1) == fp
        assert coord.wait(300) == 0, coord.output
        tree = [pid for p in procs for pid in p.tree()]
    finally:
        for p in procs:
            p.stop()
    assert_all_gone(tree)
    for p in procs[1:]:  # the very first plan, read before the peers gathered, already carried the pin
        assert "reachability check" not in p.output and "could not measure the link" not in p.output, p.output
    evals = [m["loss"] for m in read_metrics(tmp_path / "ctls") if m["kind"] == "eval"]
    assert len(evals) == 2 and evals[-1] < evals[0]


def test_fingerprints_in_records_and_plans_are_validated_and_signed_with_the_plan() -> None:
    from pydantic import ValidationError

    from coordinator.membership import make_plan
    from swarm.dht.schema import PlanPeer

    fp = tls.generate_self_signed().fingerprint
    plan = make_plan(
        fingerprints={"a": fp},
        swarm="s",
        run_id="r",
        version=1,
        model_name="gpt-tiny",
        coordinator="/ip4/127.0.0.1/tcp/1",
        stages=[(0, 1, [("a", "/ip4/127.0.0.1/tcp/2")]), (1, 3, [("b", "/ip4/127.0.0.1/tcp/3")])],
    )
    assert [p.tls_fingerprint for st in plan.stages for p in st.peers] == [fp, ""]
    assert plan.coordinator_tls_fingerprint == ""  # a coordinator in clear
    for bad in ("sha256:xyz", fp.upper(), fp + "0", "md5:" + fp[7:]):
        with pytest.raises(ValidationError):
            PlanPeer(peer_id="a", endpoint="/ip4/127.0.0.1/tcp/2", tls_fingerprint=bad)
        with pytest.raises(ValidationError):
            plan.model_validate({**plan.model_dump(), "coordinator_tls_fingerprint": bad})


def test_the_coordinator_fingerprint_is_sealed_with_the_plan_and_an_old_plan_reads_as_cleartext() -> None:
    from coordinator.membership import make_plan
    from swarm.dht.keys import generate_private_key
    from swarm.dht.records import PlanVerificationError, seal_plan, verify_plan
    from swarm.dht.schema import Plan

    fp = tls.generate_self_signed().fingerprint
    plan = make_plan(
        coordinator_tls_fingerprint=fp,
        swarm="s",
        run_id="r",
        version=1,
        model_name="gpt-tiny",
        coordinator="/ip4/127.0.0.1/tcp/1",
        stages=[(0, 3, [])],  # the first plan, published before any peer gathered, carries it already
    )
    key = generate_private_key()
    envelope = seal_plan(plan, key)
    assert verify_plan(envelope, "s", key.get_public_key()).coordinator_tls_fingerprint == fp
    tampered = {**envelope, "body": envelope["body"].replace(fp, tls.generate_self_signed().fingerprint)}
    with pytest.raises(PlanVerificationError, match="does not verify"):
        verify_plan(tampered, "s", key.get_public_key())
    older = plan.model_dump(exclude={"coordinator_tls_fingerprint"})  # a saved state from before the field
    assert Plan.model_validate(older).coordinator_tls_fingerprint == ""


def test_a_resumed_run_must_present_the_certificate_its_plan_pins(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from coordinator.cli import _tls_identity, tls_paths

    key_file = tmp_path / "ravn.coordinator.pem"
    kept = _tls_identity("self-signed", None, None, key_file, None)
    assert kept is not None and tls.load_identity(*tls_paths(key_file)) == kept

    def saved(pin: str) -> SimpleNamespace:
        return SimpleNamespace(run_id="r", plan={"coordinator_tls_fingerprint": pin})

    assert _tls_identity("self-signed", None, None, key_file, saved(kept.fingerprint)) == kept  # same files
    assert _tls_identity("off", None, None, key_file, SimpleNamespace(run_id="r", plan={})) is None  # older state
    with pytest.raises(tls.TlsError, match="started in clear"):
        _tls_identity("self-signed", None, None, key_file, saved(""))
    with pytest.raises(tls.TlsError, match=f"started with TLS certificate {kept.fingerprint}.*has no TLS"):
        _tls_identity("off", None, None, key_file, saved(kept.fingerprint))
