"""Per-sender limits (unit and on live gRPC servers, including the real peer) and tensor sanity checks."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import grpc
import pytest
import torch

from swarm.dht.signing import new_key
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.security import auth, limits
from swarm.security.identity import public_key_text
from swarm.wire import sanity
from swarm.wire.packets import WireError
from tests.security_helpers import serve


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


# ---- limits: units --------------------------------------------------------------------------------


def test_token_bucket_take_reserve_and_refill() -> None:
    b = limits.TokenBucket(rate=10.0, burst=2.0)
    assert b.try_take(1, now=0.0) and b.try_take(1, now=0.0)
    assert not b.try_take(1, now=0.0)
    assert b.try_take(1, now=0.1)  # refilled 1 token
    assert b.reserve(5, now=0.1, max_wait=1.0) == pytest.approx(0.5)
    assert b.reserve(100, now=0.1, max_wait=1.0) is None  # refused, nothing taken
    assert b.tokens == pytest.approx(-5)


def test_keyed_buckets_forget_the_least_recent_sender() -> None:
    kb = limits.KeyedBuckets(rate=1, burst=1, max_keys=2)
    kb.get("a").try_take(1, 0.0)
    kb.get("b")
    kb.get("a")
    kb.get("c")
    assert len(kb) == 2 and kb.get("a").tokens == 0.0  # "a" was used recently, "b" was dropped


def test_inflight_limiter_per_sender_and_total() -> None:
    lim = limits.InflightLimiter(per_key=2, total=3)
    lim.acquire("a")
    lim.acquire("a")
    with pytest.raises(limits.LimitExceeded, match="'a' already has 2"):
        lim.acquire("a")
    lim.acquire("b")
    with pytest.raises(limits.LimitExceeded, match="already serves 3"):
        lim.acquire("c")
    lim.release("a")
    with lim.hold("c"):
        assert lim.active == 3
    assert lim.counts == {"a": 1, "b": 1}


def test_frame_guard_bounds_the_hello_every_packet_and_every_frame() -> None:
    rules = limits.FrameRules(max_packet_bytes=1000, first_packet_bytes=100, max_frame_bytes=400)
    g = limits.FrameGuard(rules)
    with pytest.raises(limits.LimitExceeded, match="first packet"):
        g.check(pb.Frame(total_size=101, data=b"x"))
    g = limits.FrameGuard(rules)
    g.check(pb.Frame(total_size=50, data=b"x" * 50, last=True))  # the hello
    g.check(pb.Frame(total_size=900, data=b"x" * 400))
    g.check(pb.Frame(data=b"x" * 400))
    with pytest.raises(limits.LimitExceeded, match="grew past"):
        g.check(pb.Frame(data=b"x" * 300))
    g = limits.FrameGuard(rules)
    g.check(pb.Frame(total_size=0, last=True))
    with pytest.raises(limits.LimitExceeded, match="packet of 1001"):
        g.check(pb.Frame(total_size=1001))
    with pytest.raises(limits.LimitExceeded, match="frame of 401"):
        limits.FrameGuard(rules).check(pb.Frame(data=b"x" * 401))
    g = limits.FrameGuard(rules)
    with pytest.raises(limits.LimitExceeded, match="grew past"):  # a first packet that lies about its size
        for _ in range(2):
            g.check(pb.Frame(total_size=10, data=b"x" * 60))


def test_sizes_and_status_codes() -> None:
    assert limits.check_elements([2, 3]) == 6
    with pytest.raises(limits.LimitExceeded):
        limits.check_elements([1 << 20, 1 << 20], max_elements=1 << 27)
    with pytest.raises(WireError, match="negative"):
        limits.check_elements([2, -1])
    sl = limits.stage_limits(micro_batch_size=8, context=128, d_model=768)
    assert sl.max_elements == 8 * 128 * 768 and sl.max_packet_bytes > sl.max_elements * 4
    assert limits.status_code_for(limits.LimitExceeded("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert limits.status_code_for(WireError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert issubclass(limits.LimitExceeded, WireError) and issubclass(sanity.SanityError, WireError)


# ---- limits: live servers -------------------------------------------------------------------------


async def link_status(channel, frames: list[pb.Frame], *, hold: bool = False, timeout: float = 10.0):
    """Open Stage.Link, write ``frames``; return (call, code, details) or (call, None, None) if held open."""
    call = wgrpc.StageStub(channel).Link()
    try:
        for f in frames:
            await call.write(f)
        if hold:
            await asyncio.wait_for(call.read(), timeout)  # the echo of the first frame: the call is in
            return call, None, None
        await call.done_writing()
        while await asyncio.wait_for(call.read(), timeout) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass
    return call, await call.code(), await call.details()


def test_live_server_refuses_call_floods_and_too_many_streams() -> None:
    settings = limits.LimitSettings(calls_per_s=0.001, call_burst=3, inflight_per_sender=1)

    async def scenario() -> None:
        lim = limits.ServerLimits(settings)
        async with serve(interceptors=[lim]) as (target, stage, control):
            async with grpc.aio.insecure_channel(target) as ch:
                held, _, _ = await link_status(ch, [pb.Frame(packet_id=1, last=True)], hold=True)
                _, code, details = await link_status(ch, [pb.Frame(packet_id=1, last=True)])
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "calls in flight" in details
                held.cancel()
                await asyncio.sleep(0.05)
                stub = cgrpc.ControlStub(ch)
                await stub.Probe(cpb.ProbeRequest())  # third call of the burst
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Probe(cpb.ProbeRequest())
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "too many calls from addr:127.0.0.1" in e.value.details()
            assert lim.inflight.active == 0 and lim.refused == 2

    run(scenario())


def test_live_server_checks_frames_before_the_handler_sees_them() -> None:
    async def scenario() -> None:
        slow = limits.LimitSettings(bytes_per_s=1000, byte_burst=2000, max_wait_s=0.2)
        async with serve(interceptors=[limits.ServerLimits(slow)]) as (target, stage, _):
            async with grpc.aio.insecure_channel(target) as ch:
                _, code, details = await link_status(ch, [pb.Frame(packet_id=1, total_size=1 << 20)])
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "first packet (the hello)" in details
                hello = pb.Frame(packet_id=0, data=b"h" * 10, total_size=10, last=True)
                big = [pb.Frame(packet_id=1, data=b"x" * 500, total_size=500, last=True) for _ in range(8)]
                _, code, details = await link_status(ch, [hello, *big])
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds 0.001 MB/s" in details
        patient = limits.LimitSettings(bytes_per_s=1000, byte_burst=1000, max_wait_s=1.0)
        async with serve(interceptors=[limits.ServerLimits(patient)]) as (target, stage, _):
            async with grpc.aio.insecure_channel(target) as ch:
                t0 = time.monotonic()
                _, code, details = await link_status(ch, [hello, *big[:3]])  # 1510 bytes: throttled, not refused
                assert code == grpc.StatusCode.OK, details
                assert time.monotonic() - t0 > 0.4

    run(scenario())


def test_limits_behind_auth_charge_the_proven_peer_and_wrap_async_generators() -> None:
    token = auth.generate_token()
    seen: list[str] = []

    def key(context) -> str:
        seen.append(limits.sender_key(context))
        return seen[-1]

    signer = new_key()

    async def scenario() -> None:
        interceptors = [auth.ServerAuth(auth.Verifier(token)), limits.ServerLimits(key=key)]
        async with serve(interceptors=interceptors) as (target, _, control):
            async with grpc.aio.insecure_channel(
                target, interceptors=auth.client_interceptors(token, "peer-9", "x", signer=signer)
            ) as ch:
                commands = [c async for c in cgrpc.ControlStub(ch).Join(cpb.JoinRequest(peer_id="p"))]
                assert [c.shutdown.reason for c in commands] == ["p-0", "p-1", "p-2"]

                async def frames():
                    for i in range(3):
                        yield pb.Frame(packet_id=i, data=b"x", total_size=1, last=True)

                assert (await cgrpc.ControlStub(ch).UploadState(frames())).tensors == 3
        charged = f"peer:peer-9:{public_key_text(signer)}"  # the name with the key that signed it
        assert seen == [charged, charged]

    run(scenario())


def test_real_peer_behind_limits_refuses_a_hello_flood_and_keeps_serving() -> None:
    """The pre-hello buffering hole of the bare peer (see test_fuzz) closed by the interceptor alone."""
    from peer.daemon import PeerDaemon
    from peer.stage_service import StageService
    from swarm.pb import wire_pb2_grpc
    from swarm.wire.transport import GRPC_OPTIONS
    from tests.sealed_plans import peer_settings
    from tests.test_bad_input import HELLO, activations, frames, good_hidden
    from tests.test_fuzz import assignment, served_gradient

    async def scenario() -> None:
        daemon = PeerDaemon(peer_settings("last", device="cpu"))
        server = grpc.aio.server(interceptors=[limits.ServerLimits()], options=GRPC_OPTIONS + limits.SERVER_OPTIONS)
        wire_pb2_grpc.add_StageServicer_to_server(StageService(daemon.stage_host()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        daemon._server = server
        try:
            await daemon.session._on_assign(assignment())
            target = f"127.0.0.1:{port}"
            flood = pb.Frame(packet_id=1, data=b"\0" * 65536, total_size=64 << 20)
            code, details = await status_without_half_close(target, [flood])
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "the hello" in details
            huge = pb.Frame(packet_id=5, total_size=1 << 30)
            code, details = await status_without_half_close(target, [*frames(HELLO), huge])
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds the limit" in details
            grad = await served_gradient(target, frames(HELLO, activations(limits_pb_hidden(good_hidden()), 3)))
            assert grad is not None and bool(torch.isfinite(grad).all())
        finally:
            await daemon.close()

    run(scenario())


async def status_without_half_close(target: str, frames: list[pb.Frame]) -> tuple[grpc.StatusCode, str]:
    """Write ``frames`` and wait for the server to end the call by itself.

    No further writes and no half-close: a write that races the server's status makes grpc.aio report
    INTERNAL instead of the server's status (grpc/grpc#36066).
    """
    async with grpc.aio.insecure_channel(target) as channel:
        call = wgrpc.StageStub(channel).Link()
        for f in frames:
            await call.write(f)

        async def drain() -> None:  # the status only arrives once the replies before it are read
            with contextlib.suppress(grpc.aio.AioRpcError):
                while await call.read() is not grpc.aio.EOF:
                    pass

        await asyncio.wait_for(drain(), 10)
        return await call.code(), await call.details()


def limits_pb_hidden(x: torch.Tensor) -> pb.Tensor:
    from swarm.wire.packets import tensor_to_pb

    return tensor_to_pb(x, "fp32")


# ---- sanity ---------------------------------------------------------------------------------------


def feed(checker: sanity.LinkSanity, norms: list[float], *, sender: str = "up", kind: str = "activations"):
    """Check tensors of the given norms; returns the list of refusal texts (None where accepted)."""
    out = []
    for n in norms:
        x = torch.full((4, 16), n / 8.0)  # 64 equal elements: norm = n
        try:
            checker.check(x, sender=sender, link="up->me", kind=kind)
            out.append(None)
        except sanity.SanityError as e:
            out.append(str(e))
    return out


def test_norm_tracker_warms_up_then_refuses_outliers_without_learning_them() -> None:
    t = sanity.NormTracker(sanity.SanitySettings(warmup=4, z_max=4, min_std=0.1))
    for n in (1.0, 1.1, 0.9, 1.0):
        assert t.judge(n) is None
        t.update(n)
    assert t.warm and abs(t.mean) < 0.05
    assert t.judge(1.2) is None
    assert "above" in t.judge(100.0) and "below" in t.judge(0.01)
    assert t.judge(0.0) is not None  # an all-zero tensor is the far low end, not a math error
    mean = t.mean
    t.update(1.3)
    assert t.mean > mean  # the EMA moves with accepted samples


def test_link_sanity_refuses_nonfinite_huge_and_outlying_tensors_and_quarantines() -> None:
    clock = [0.0]
    q = sanity.Quarantine(max_rejections=3, window_s=10, clock=lambda: clock[0])
    chk = sanity.LinkSanity(sanity.SanitySettings(warmup=8, z_max=6, max_abs=1e6), q)
    nan = torch.ones(2, 3)
    nan[1, 1] = math.nan
    with pytest.raises(sanity.SanityError, match="NaN or Inf"):
        chk.check(nan, sender="up", link="l", kind="activations")
    with pytest.raises(sanity.SanityError, match="magnitude 1e\\+20"):  # even during warm-up
        chk.check(torch.full((2, 2), 1e20), sender="up", link="l", kind="activations")
    with pytest.raises(sanity.SanityError, match="floating point"):
        chk.check(torch.ones(2, dtype=torch.int64), sender="other", link="l", kind="activations")
    assert chk.rejections == {"up": 2, "other": 1} and not q.excluded("up")
    clock[0] = 20.0  # the window passed: old rejections no longer count
    assert feed(chk, [10.0 * (1 + 0.05 * (i % 3)) for i in range(8)]) == [None] * 8
    assert feed(chk, [10.5, 12.0, 9.0]) == [None] * 3
    refused = feed(chk, [1e5, 1e-5])
    assert "above" in refused[0] and "below" in refused[1] and not q.excluded("up")
    assert feed(chk, [10.0]) == [None]  # outliers did not shift the statistics
    gradients = feed(chk, [1e-3] * 8, kind="gradients")  # its own statistics per direction
    assert gradients == [None] * 8
    last = feed(chk, [1e6 / 8])
    assert "now quarantined" in last[0] and q.excluded("up")
    assert "quarantined" in feed(chk, [10.0])[0]  # refused outright from now on
    assert "3 rejected tensors within 10 s" in chk.status()["up"]
    q.release("up")
    assert feed(chk, [10.0]) == [None]


def test_gradual_drift_is_followed_but_a_jump_is_not() -> None:
    chk = sanity.LinkSanity(sanity.SanitySettings(warmup=8))
    norms = [1.0 * 1.05**i for i in range(120)]  # x340 over 120 micro-batches, 5% at a time
    assert feed(chk, norms) == [None] * len(norms)
    assert feed(chk, [norms[-1] * 1000])[0] is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tensors_are_measured_in_float32(dtype) -> None:
    finite, max_abs, norm = sanity.tensor_stats(torch.full((1000,), 60000.0, dtype=dtype))
    assert finite and math.isfinite(norm) and norm == pytest.approx(60000.0 * math.sqrt(1000), rel=0.01)
    assert max_abs == pytest.approx(60000.0, rel=0.01)
    empty = torch.zeros(0, dtype=dtype)
    assert sanity.tensor_stats(empty) == (True, 0.0, 0.0)  # an empty reduction must not raise
    chk = sanity.LinkSanity()
    assert feed(chk, [10.0] * chk.s.warmup) == [None] * chk.s.warmup
    with pytest.raises(sanity.SanityError, match="below"):  # carries nothing: as implausible as a zero tensor
        chk.check(empty, sender="up", link="up->me", kind="activations")
