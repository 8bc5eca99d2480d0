"""TLS wired in, on real processes: peers serve their stage over TLS with self-signed certificates, the
fingerprints travel in their DHT records and the signed plan, the dialling neighbour pins them, and the
swarm trains. A dialler with the wrong pin, or in clear, is refused by the same live peer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from swarm import tls
from swarm.multiaddrs import multiaddr_to_grpc_target
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from tests.conftest import read_metrics
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


def test_fingerprints_in_records_and_plans_are_validated_and_signed_with_the_plan() -> None:
    from pydantic import ValidationError

    from coordinator.membership import make_plan
    from swarm.dht_schema import PlanPeer

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
    for bad in ("sha256:xyz", fp.upper(), fp + "0", "md5:" + fp[7:]):
        with pytest.raises(ValidationError):
            PlanPeer(peer_id="a", endpoint="/ip4/127.0.0.1/tcp/2", tls_fingerprint=bad)
