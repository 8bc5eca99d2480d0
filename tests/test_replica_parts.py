"""Replicas, piece by piece: routing, step shares, the runner's quotas and averaging, the averaging group."""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest
import torch

from peer.replicas.averaging import AverageGroup, AverageRefused, decode_deltas, encode_deltas
from peer.replicas.routing import ReplicaRouter
from peer.replicas.shares import SenderSplit, UpstreamShares
from swarm.config import ModelConfig, TrainConfig
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.train.stage_runner import StageRunner
from swarm.wire.sanity import LinkSanity

CFG = ModelConfig(n_layers=3, d_model=32, n_heads=2, vocab_size=64, context=16)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_router_sends_less_to_a_slower_replica_and_knows_what_a_lost_one_held() -> None:
    clock = Clock()
    router = ReplicaRouter(["fast", "slow"], clock=clock)
    for i in range(4):  # learn: "slow" takes 4x as long per micro-batch
        router.sent("fast", 2 * i)
        router.sent("slow", 2 * i + 1)
        clock.t += 1.0
        router.returned(2 * i)
        clock.t += 3.0
        router.returned(2 * i + 1)
    sent = {"fast": 0, "slow": 0}
    for mb in range(100, 120):
        peer = router.choose()
        router.sent(peer, mb)
        sent[peer] += 1
    assert sent["fast"] >= 3 * sent["slow"] > 0
    held = [mb for mb in range(100, 120) if router.holder(mb) == "slow"]
    assert router.remove("slow") == held
    assert router.peers == ["fast"] and all(router.choose() == "fast" for _ in range(3))
    assert router.returned(held[0]) is None  # a late gradient from the vanished replica is not misrouted


def test_router_spreads_over_untried_replicas_by_queue() -> None:
    router = ReplicaRouter(["a", "b", "c"], clock=Clock())
    chosen = []
    for mb in range(6):
        peer = router.choose()
        router.sent(peer, mb)
        chosen.append(peer)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(ValueError):
        ReplicaRouter([])


def test_sender_split_reports_each_step_once_with_counts_per_replica() -> None:
    split = SenderSplit(["r1", "r2"], fixed=3)
    split.forwarded(0, "r1")
    split.forwarded(0, "r2")
    assert split.complete() == []
    split.forwarded(1, "r2")  # async: the next step starts before this one is out
    split.forwarded(0, "r1")
    assert split.complete() == [(0, {"r1": 2, "r2": 1})]
    assert split.complete() == []
    replica = SenderSplit(["d"], fixed=None)  # a replica forwards its own share, known from its markers
    assert replica.complete() == []
    replica.expect(5, 0)
    assert replica.complete() == [(5, {"d": 0})]


def test_upstream_shares_add_markers_and_survive_a_vanished_sender() -> None:
    shares = UpstreamShares(["u1", "u2"])
    assert shares.marker(0, "u1", 2) == []
    assert shares.marker(0, "u2", 1) == [(0, 3)]
    shares.received(1, "u1")
    shares.received(1, "u2")
    shares.received(1, "u2")
    assert shares.marker(1, "u1", 1) == []
    assert shares.remove("u2") == [(1, 3)]  # u2 sent 2 before it vanished; that is all it will send
    assert shares.marker(2, "u1", 4) == [(2, 4)]
    with pytest.raises(ValueError):
        shares.marker(2, "u1", 1)  # a second marker for a finished step
    with pytest.raises(ValueError):
        shares.marker(3, "stranger", 1)


def _runner(**train) -> StageRunner:
    return StageRunner(CFG, TrainConfig(micro_batches=2, micro_batch_size=2, lr=1e-2, warmup_steps=0, **train), 1, 2)


def _fwd_bwd(runner: StageRunner, mb: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, CFG.d_model, generator=g)
    runner.forward(mb, x)
    runner.backward(mb, torch.randn(2, 8, CFG.d_model, generator=g))


def test_a_replica_steps_after_its_share_including_an_empty_one() -> None:
    runner = _runner()
    runner.use_quotas()
    _fwd_bwd(runner, 1, 0)
    assert runner.version == 0  # share unknown yet: no step
    assert runner.expect(1) and runner.version == 1
    assert runner.expect(0) and runner.version == 2  # a step routed nothing here still advances the version
    runner.expect(2)
    _fwd_bwd(runner, 2, 1)
    assert runner.version == 2
    assert runner.count_lost() and runner.version == 3  # its second micro-batch vanished with a replica


def test_micro_batches_beyond_a_share_count_for_the_next_step() -> None:
    """Async: the next step's gradients may arrive before this step's share is known; none is forgotten."""
    runner = _runner()
    runner.use_quotas()
    for mb in (1, 2, 3):
        _fwd_bwd(runner, mb, mb)
    assert runner.expect(2) and runner.version == 1  # two of the three close this step...
    assert runner.expect(1) and runner.version == 2  # ...the third already completes the next one


def test_averaging_moves_replicas_to_the_same_parameters_and_keeps_local_progress() -> None:
    a, b = _runner(), _runner()
    for r in (a, b):
        r.use_quotas()
        r.start_averaging()
    assert a.agreed.digest() == b.agreed.digest()  # same seed, same start
    for i, r in enumerate((a, b)):
        r.expect(2)
        _fwd_bwd(r, 1, 10 + i)
        _fwd_bwd(r, 2, 20 + i)
    da, db = a.agreed.delta(), b.agreed.delta()
    mean = {k: (da[k] + db[k]) / 2 for k in da}
    a.forward(3, torch.randn(2, 8, CFG.d_model))  # in flight across the average: its graph must not break
    for r, own in ((a, da), (b, db)):
        r.apply_average(mean, own, outer_lr=1.0, momentum=0.0)
    assert a.agreed.digest() == b.agreed.digest()
    for (_, pa), (_, pb_) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert float((pa - pb_).detach().abs().max()) <= 1e-6
    a.expect(1)
    a.backward(3, torch.randn(2, 8, CFG.d_model))  # recomputed with the averaged weights
    assert a.version == 2
    with pytest.raises(ValueError):
        a.apply_average({k: v * float("nan") for k, v in mean.items()}, da, 1.0, 0.0)


def test_nesterov_outer_step_is_the_same_on_every_replica() -> None:
    a, b = _runner(), _runner()
    for r in (a, b):
        r.start_averaging()
    change = {k: torch.full_like(v, 0.01) for k, v in a.agreed.delta().items()}
    zero = {k: torch.zeros_like(v) for k, v in change.items()}
    for r in (a, b):
        r.apply_average(change, zero, outer_lr=0.7, momentum=0.9)
        r.apply_average(change, zero, outer_lr=0.7, momentum=0.9)
    assert a.agreed.digest() == b.agreed.digest()
    name, p = next(iter(a.model.named_parameters()))
    start = _runner().model.state_dict()[name]
    # two Nesterov outer steps on a constant change c: 0.7*(c + 0.9c) + 0.7*(c + 0.9*1.9c)
    expected = 0.7 * (0.01 + 0.9 * 0.01) + 0.7 * (0.01 + 0.9 * 1.9 * 0.01)
    assert torch.allclose(p.detach() - start, torch.full_like(p, expected), atol=1e-6)


async def _insecure(target: str, peer: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target)


def _group(me: str, members: dict[str, str], timeout: float = 2.0, **kw) -> AverageGroup:
    return AverageGroup(
        me,
        members,
        run_id="run",
        layers=(1, 2),
        shapes={"w": (4,)},
        codec="fp32",
        timeout=timeout,
        channel=_insecure,
        **kw,
    )


def _request(peer: str, round_: int, value: float) -> pb.AverageRequest:
    deltas = encode_deltas({"w": torch.full((4,), value)}, "fp32")
    return pb.AverageRequest(run_id="run", round=round_, layer_start=1, layer_end=2, deltas=deltas, peer_id=peer)


def test_leader_averages_everyone_and_closes_a_round_without_a_dead_member() -> None:
    async def scenario() -> None:
        leader = _group("a", {"a": "x", "b": "y", "c": "z"}, timeout=0.5)
        replies = await asyncio.gather(
            leader.collect(_request("a", 1, 1.0), "a"),
            leader.collect(_request("b", 1, 2.0), "b"),
            leader.collect(_request("c", 1, 6.0), "c"),
        )
        assert all(r is replies[0] for r in replies)  # one encoding, the same bytes for everyone
        assert list(replies[0].contributors) == ["a", "b", "c"]
        # "c" died: the round closes after the timeout with the others, and later rounds do not wait for it
        r2 = await asyncio.gather(
            leader.collect(_request("a", 2, 1.0), "a"), leader.collect(_request("b", 2, 3.0), "b")
        )
        assert list(r2[0].contributors) == ["a", "b"] and leader.absent == {"c"}
        late = await leader.collect(_request("c", 2, 100.0), "c")  # "c" was only slow: it adopts the result
        assert late is r2[0]
        for bad, code in (
            (_request("mallory", 3, 1.0), grpc.StatusCode.PERMISSION_DENIED),
            (
                pb.AverageRequest(run_id="other", round=3, layer_start=1, layer_end=2, peer_id="b"),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
        ):
            with pytest.raises(AverageRefused) as e:
                await leader.collect(bad, bad.peer_id)
            assert e.value.code == code
        wrong_shape = _request("b", 3, 1.0)
        wrong_shape.deltas[0].CopyFrom(encode_deltas({"w": torch.ones(5)}, "fp32")[0])
        with pytest.raises(AverageRefused):
            await leader.collect(wrong_shape, "b")
        nan = _request("b", 3, 1.0)
        nan.deltas[0].tensor.payload = struct.pack("<4f", *[float("nan")] * 4)  # what a hostile peer could send
        with pytest.raises(AverageRefused):
            await leader.collect(nan, "b")

    asyncio.run(scenario())


def test_a_lying_replica_contribution_is_refused_charged_and_quarantined() -> None:
    """Issue 16 item 8: a finite but huge change (x1e4 the leader's own) used to be averaged in unchecked."""
    sanity = LinkSanity()

    async def scenario() -> None:
        leader = _group("a", {"a": "x", "b": "y", "c": "z"}, timeout=0.5, sanity=sanity)
        for round_ in (1, 2, 3):
            honest, lie = await asyncio.gather(
                asyncio.gather(*(leader.collect(_request(p, round_, v), p) for p, v in (("a", 1.0), ("b", 2.0)))),
                leader.collect(_request("c", round_, 1e4), "c"),
                return_exceptions=True,
            )
            assert isinstance(lie, AverageRefused) and lie.code == grpc.StatusCode.INVALID_ARGUMENT, lie
            reply = honest[0]
            assert list(reply.contributors) == ["a", "b"]  # the lie is not in the average
            mean = decode_deltas(reply.deltas)["w"]
            assert torch.allclose(mean, torch.full((4,), 1.5))
        assert sanity.rejections["c"] == 3 and sanity.quarantine.excluded("c")  # charged like a bad tensor
        with pytest.raises(AverageRefused) as e:  # quarantined: refused at once, even with an honest change
            await leader.collect(_request("c", 4, 1.0), "c")
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert not sanity.rejections["b"]

    asyncio.run(scenario())


def test_an_average_far_beyond_the_replicas_own_change_is_not_applied() -> None:
    """The other direction: a lying leader answers with an average x1e4 the contributor's own change."""

    async def scenario() -> None:
        sanity = LinkSanity()
        member = _group("b", {"a": "unused", "b": "unused"}, timeout=0.5, sanity=sanity)

        class LyingLeader(wgrpc.StageServicer):
            async def Average(self, request, context):  # noqa: N802 - gRPC name
                huge = encode_deltas({"w": torch.full((4,), 1e4)}, "fp32")
                return pb.AverageReply(round=request.round, deltas=huge, contributors=["a", "b"])

        server = grpc.aio.server()
        wgrpc.add_StageServicer_to_server(LyingLeader(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            member.set_members({"a": f"127.0.0.1:{port}", "b": "unused"})
            assert await member.contribute(1, {"w": torch.ones(4)}) is None  # nothing applied
        finally:
            await server.stop(None)
        assert sanity.rejections["a"] == 1

    asyncio.run(scenario())


def test_a_member_whose_leader_is_gone_applies_nothing() -> None:
    async def scenario() -> None:
        member = _group("b", {"a": "127.0.0.1:1", "b": "unused"}, timeout=0.5)
        assert await member.contribute(1, {"w": torch.ones(4)}) is None

    asyncio.run(scenario())


def test_a_replica_steps_on_the_mean_over_its_share() -> None:
    """Gradients arrive scaled by 1/K (the step's K micro-batches); a replica that saw only n of them steps
    on K/n times their sum, so its gradient scale does not jump when its share changes."""

    def captured(runner: StageRunner) -> list[torch.Tensor]:
        grads: list[torch.Tensor] = []
        runner.step = lambda: grads.extend(p.grad.clone() for p in runner.trainable)  # type: ignore[method-assign]
        return grads

    replica = _runner()  # K = 2
    replica.use_quotas()
    alone = StageRunner(CFG, TrainConfig(micro_batches=1, micro_batch_size=2, lr=1e-2, warmup_steps=0), 1, 2)
    got, ref = captured(replica), captured(alone)
    replica.expect(1)
    _fwd_bwd(replica, 1, 7)
    _fwd_bwd(alone, 1, 7)
    assert got and all(torch.allclose(g, 2 * r) for g, r in zip(got, ref, strict=True))
