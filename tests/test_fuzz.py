"""Fuzz a LIVE peer: >= 10,000 hostile messages, then check it still computes correct gradients.

The peer is the real daemon with its real gRPC server on loopback (as in test_bad_input), holding the
last stage of a 2-stage gpt-tiny, started with a swarm token: its server runs the same auth and limit
interceptors as every real peer (``PeerDaemon.start_server``). The test dials its Stage.Link as the
upstream neighbour would, with that member's proofs, and opens streams no faster than the peer's
per-sender call rate (what it refuses beyond that rate is RESOURCE_EXHAUSTED, an expected status). Each
refusal ends one stream, so the messages are spread over many streams (mostly one after another, some
concurrent). Message families:

* random bytes as gRPC messages (not even a Frame), and random Frames;
* valid packets cut into small frames, then mutated: bit flips, truncation, dropped, duplicated and
  swapped frames, wrong packet ids, early or missing ``last``, huge or wrong ``total_size``;
* hypothesis-built Packets and Tensors: extreme shapes, unknown dtypes and codecs, block sizes, seeds,
  hostile fp16 scales, and "consistent" tensors whose payload has exactly the right size, so the codecs
  and the stage's own checks are reached;
* concurrent streams that all claim to be the upstream neighbour.

Asserted: every stream ends with a gRPC status within its timeout (no hang), the peer keeps serving,
the process's RSS stays bounded, and afterwards a valid micro-batch gets exactly the gradients that the
same stage computes locally with the same weights. The seed is fixed (RAVN_FUZZ_SEED overrides it).

Bugs found in code this test does not own are pinned by ``xfail(strict=True)`` tests at the bottom,
each with its reproducer; inputs of the main run that would trigger them are filtered (``poisons``),
so the main run stays meaningful until they are fixed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import random
import time

import grpc
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from peer.compute import BACKWARD
from peer.daemon import PeerDaemon
from swarm.config import TrainConfig
from swarm.dht.multiaddrs import multiaddr_to_grpc_target
from swarm.dht.signing import new_key
from swarm.messages import model_to_pb, train_to_pb
from swarm.pb import control_pb2 as cpb
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.security import auth
from swarm.security.identity import public_key_text
from swarm.security.limits import LimitSettings, TokenBucket
from swarm.train.stage_runner import StageRunner
from swarm.wire.packets import Reassembler, split_packet, tensor_from_pb
from tests.fuzz_inputs import (
    CFG,
    FILTERED,
    HELLO_FRAMES,
    B,
    T,
    activation_packet,
    good_packet,
    hostile_packet,
    mutated_stream,
    poisons,
    random_frames,
    raw_messages,
)
from tests.sealed_plans import assignment as sealed_assignment
from tests.sealed_plans import peer_settings

TRAIN = TrainConfig(micro_batches=1, micro_batch_size=B)
LINK = "/ravn.wire.Stage/Link"
STREAM_TIMEOUT = float(os.environ.get("RAVN_FUZZ_STREAM_TIMEOUT", "30"))
MIN_MESSAGES = 10_000
TOKEN = auth.generate_token()
UPSTREAM_KEY = new_key()  # the upstream member's record key, which the target's plan pins
RSS_GROWTH_LIMIT_MB = 200
POISON_ABS = 1e15  # finite activations beyond this poison the last stage's weights (xfail below)
SEED = int(os.environ.get("RAVN_FUZZ_SEED", "1117"))
SCALE = float(os.environ.get("RAVN_FUZZ_SCALE", "1"))  # e.g. 20 for a long local run

# Statuses a stream may end with. UNKNOWN (an exception escaped the handler) is a bug everywhere except
# for the two known cases matched by text; see the xfail tests.
EXPECTED_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
KNOWN_UNKNOWN: tuple[str, ...] = ()  # finding 4 (DecodeError -> UNKNOWN) is fixed
# grpc.aio client bug (grpc/grpc#36066): a write that fails because the server already ended the call
# overwrites the server's status with this one on the client side. The server did send its status.
MASKED_STATUS = "Internal error from Core"


# ---- the live peer and how to talk to it ----------------------------------------------------------


def assignment(upstream_key: str | None = None) -> cpb.Assignment:
    """The last stage of two; the sealed plan pins ``upstream_key`` (default: UPSTREAM_KEY's) for "upstream"."""
    key = upstream_key or public_key_text(UPSTREAM_KEY)
    stages = [(0, 1, [("upstream", "/ip4/127.0.0.1/tcp/1")]), (1, CFG.n_layers, [("last", "/ip4/127.0.0.1/tcp/2")])]
    return sealed_assignment(
        stages, plan_kw={"public_keys": {"upstream": key}}, model=model_to_pb(CFG), train=train_to_pb(TRAIN)
    )


class Pace:
    """Opens calls at most at ``rate`` per second (the peer refuses a member's calls beyond its rate limit)."""

    def __init__(self, rate: float) -> None:
        self.bucket = TokenBucket(rate, burst=rate)

    async def __call__(self) -> None:
        wait = self.bucket.reserve(1.0, time.monotonic(), math.inf)
        if wait:
            await asyncio.sleep(wait)


PACE = Pace(0.9 * LimitSettings().calls_per_s)


async def start_peer() -> tuple[PeerDaemon, str]:
    daemon = PeerDaemon(peer_settings("last", device="cpu", swarm_token=TOKEN))
    endpoint = await daemon.start_server()
    await daemon.session._on_assign(assignment())  # its sealed plan pins the upstream's key
    return daemon, multiaddr_to_grpc_target(endpoint)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def open_channel(target: str) -> grpc.aio.Channel:
    """A channel whose calls carry the upstream member's proofs, as a real neighbour's do."""
    interceptors = auth.client_interceptors(TOKEN, "upstream", "last", signer=UPSTREAM_KEY)
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


@contextlib.asynccontextmanager
async def raw_channel(target: str):
    async with await open_channel(target) as channel:
        yield channel


async def stream(
    channel: grpc.aio.Channel, messages: list, *, raw: bool = False, concurrent_read: bool = True
) -> tuple[int, grpc.StatusCode, str, list[pb.Frame]]:
    """Write ``messages`` on one Link, half-close, drain; (messages written, status, details, replies)."""
    await PACE()
    if raw:
        call = channel.stream_stream(LINK, request_serializer=lambda b: b, response_deserializer=pb.Frame.FromString)()
    else:
        call = wgrpc.StageStub(channel).Link()
    replies: list[pb.Frame] = []

    async def drain() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            while (frame := await call.read()) is not grpc.aio.EOF:
                replies.append(frame)

    reader = asyncio.ensure_future(drain())
    sent = 0
    try:
        for m in messages:
            if call.done():
                break
            await call.write(m)
            sent += 1
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass
    await reader
    return sent, await call.code(), await call.details() or "", replies


async def exchange_status(target: str, frames: list[pb.Frame], timeout: float = STREAM_TIMEOUT):
    """(status, details) of one Link carrying ``frames``."""
    async with raw_channel(target) as channel:
        _, code, details, _ = await asyncio.wait_for(stream(channel, frames), timeout)
    return code, details


async def served_gradient(target: str, frames: list[pb.Frame]) -> torch.Tensor | None:
    """Send hello + one activations packet; the gradient tensor that comes back (None if refused)."""
    async with raw_channel(target) as channel:
        _, code, details, replies = await asyncio.wait_for(stream(channel, frames), STREAM_TIMEOUT)
    reasm, packets = Reassembler(), []
    for f in replies:
        p = reasm.push(f)
        if p is not None:
            packets.append(p)
    grads = [p.gradients for p in packets if p.WhichOneof("body") == "gradients"]
    if not grads:
        return None
    return tensor_from_pb(grads[0].grad)


# ---- the fuzz run ---------------------------------------------------------------------------------


class Tally:
    """What happened to every stream, by message family."""

    def __init__(self) -> None:
        self.messages = 0
        self.streams = 0
        self.codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.unexpected: list[str] = []

    def add(self, family: str, sent: int, code: grpc.StatusCode, details: str) -> None:
        self.messages += sent
        self.streams += 1
        self.codes[family][code.name] += 1
        if (
            code not in EXPECTED_CODES
            and not (code == grpc.StatusCode.UNKNOWN and any(k in details for k in KNOWN_UNKNOWN))
            and not (code == grpc.StatusCode.INTERNAL and details == MASKED_STATUS)
        ):
            self.unexpected.append(f"{family}: {code.name} {details[:200]}")


async def fuzz_stream(channel, tally: Tally, family: str, messages: list, *, raw: bool = False) -> None:
    try:
        sent, code, details, _ = await asyncio.wait_for(stream(channel, messages, raw=raw), STREAM_TIMEOUT)
    except TimeoutError:
        tally.unexpected.append(f"{family}: stream did not end within {STREAM_TIMEOUT} s (hang)")
        return
    tally.add(family, sent, code, details)


@pytest.mark.slow  # a whole swarm for a minute or more: keeps the default suite well under 10 minutes (CI)
def test_live_peer_survives_fuzzing_and_still_computes_correct_gradients() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: the compute thread must not fight the event loop
    loop = asyncio.new_event_loop()  # one loop for the peer, the streams and every hypothesis example
    asyncio.set_event_loop(loop)
    rng = random.Random(SEED)
    tally = Tally()
    t0 = time.perf_counter()
    daemon, target = loop.run_until_complete(start_peer())
    channel = loop.run_until_complete(open_channel(target))  # grpc.aio binds a channel to the running loop
    try:
        # warm up (first forward, first stream), then take the memory baseline
        loop.run_until_complete(
            fuzz_stream(channel, tally, "valid", HELLO_FRAMES + list(split_packet(good_packet(rng, 1), 1)))
        )
        rss_before = rss_mb()

        async def families() -> None:
            for i in range(int(250 * SCALE)):
                await fuzz_stream(channel, tally, "mutated", mutated_stream(rng, 1000 + 10 * i))
            for _ in range(int(120 * SCALE)):
                await fuzz_stream(channel, tally, "random", random_frames(rng))
            for _ in range(int(100 * SCALE)):
                await fuzz_stream(channel, tally, "raw", raw_messages(rng), raw=True)
            for r in range(int(12 * SCALE)):  # several "upstreams" at once: links replace each other mid-stream
                batch = [
                    mutated_stream(rng, 50_000 + 100 * r + k)
                    if k % 2
                    else HELLO_FRAMES + list(split_packet(good_packet(rng, 60_000 + 100 * r + k), 1))
                    for k in range(6)
                ]
                await asyncio.gather(*(fuzz_stream(channel, tally, "concurrent", m) for m in batch))

        loop.run_until_complete(families())

        @settings(
            max_examples=int(300 * SCALE),
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @seed(SEED)
        @given(
            packets=st.lists(hostile_packet(), min_size=1, max_size=4), frame_bytes=st.sampled_from([32, 256, 1 << 20])
        )
        def hypothesis_streams(packets: list[pb.Packet], frame_bytes: int) -> None:
            for k, p in enumerate(packets):
                if poisons(p):
                    FILTERED["hypothesis"] += 1
                    continue
                frames = HELLO_FRAMES + list(split_packet(p, k + 1, frame_bytes))
                loop.run_until_complete(fuzz_stream(channel, tally, "hypothesis", frames))

        hypothesis_streams()
        fuzz_seconds = time.perf_counter() - t0
        rss_after = rss_mb()

        # the fuzzer sent NaN and absurd norms as "upstream": the peer dropped them and may have quarantined
        # it (tests/test_sanity_wired.py); an operator forgives it, so the check below is served again
        rejected = sum(daemon.stage.sanity.rejections.values())
        daemon.stage.sanity.forgive("upstream")
        # still alive, and still right: gradients equal to the same stage computed here
        state = loop.run_until_complete(
            daemon.run_compute(
                lambda: {k: v.detach().clone() for k, v in daemon.stage.runner.model.state_dict().items()}
            )
        )
        assert all(bool(torch.isfinite(v).all()) for v in state.values()), "fuzzing corrupted the weights"
        g = torch.Generator().manual_seed(SEED)
        x = torch.randn(B, T, CFG.d_model, generator=g)
        y = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
        local = StageRunner(CFG, TRAIN, 1, CFG.n_layers, "cpu")
        local.model.load_state_dict(state)
        expected = local.forward(1, x, y).input_grad
        got = loop.run_until_complete(
            served_gradient(target, HELLO_FRAMES + list(split_packet(activation_packet(x, y, 999_999_999), 1)))
        )
    finally:
        loop.run_until_complete(channel.close())
        loop.run_until_complete(daemon.close())
        loop.close()
        asyncio.set_event_loop(None)
        torch.set_num_threads(threads)
    summary = {family: dict(c) for family, c in tally.codes.items()}
    print(
        f"\nfuzz: {tally.messages} messages on {tally.streams} streams in {fuzz_seconds:.1f} s; "
        f"RSS {rss_before:.0f} -> {rss_after:.0f} MB; refused by the peer: {daemon.stage.refused}; "
        f"rejected: {rejected}; "
        f"skipped as poisonous (finding 1): {dict(FILTERED)}; {summary}"
    )
    assert not tally.unexpected, "\n".join(tally.unexpected[:20])
    assert tally.messages >= MIN_MESSAGES, tally.messages
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_MB, (rss_before, rss_after)
    assert got is not None, "the peer no longer serves a valid micro-batch"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    served = tally.codes["mutated"]["OK"] + tally.codes["hypothesis"]["OK"]
    assert served > 0 and tally.codes["mutated"]["INVALID_ARGUMENT"] > 0  # both paths were exercised


# ---- findings in code this file does not own (fixed = remove the xfail) ---------------------------


def with_fresh_peer(scenario) -> None:
    async def main() -> None:
        daemon, target = await start_peer()
        try:
            await scenario(daemon, target)
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def good_frames(mb_id: int, scale: float = 1.0, batch: int = B) -> list[pb.Frame]:
    g = torch.Generator().manual_seed(mb_id)
    hidden = torch.randn(batch, T, CFG.d_model, generator=g) * scale
    targets = torch.randint(0, CFG.vocab_size, (batch, T), generator=g)
    return HELLO_FRAMES + list(split_packet(activation_packet(hidden, targets, mb_id), 1))


def test_huge_finite_activations_do_not_poison_the_weights() -> None:
    async def scenario(daemon: PeerDaemon, target: str) -> None:
        await exchange_status(target, good_frames(1, scale=1e20))  # finite, so the NaN check passes it
        assert all(bool(torch.isfinite(p).all()) for p in daemon.stage.runner.model.parameters())
        assert await served_gradient(target, good_frames(2)) is not None

    with_fresh_peer(scenario)


def test_the_first_packet_of_a_link_is_bounded_before_the_hello() -> None:
    async def scenario(daemon: PeerDaemon, target: str) -> None:
        flood = [pb.Frame(packet_id=1, data=bytes(1 << 20), total_size=500 << 20)] + [
            pb.Frame(packet_id=1, data=bytes(1 << 20)) for _ in range(3)
        ]
        async with raw_channel(target) as channel:
            call = wgrpc.StageStub(channel).Link()
            try:
                for f in flood:
                    await call.write(f)
            except Exception:  # noqa: BLE001 - grpc raises AioRpcError or its cython ExecuteBatchError here
                pass  # error when the peer already ended the call while we still write: that is the refusal
            # no half-close: a refusing peer ends the call now, a buffering one waits for 496 MiB more
            code = await asyncio.wait_for(call.code(), 3.0)
        assert code != grpc.StatusCode.OK

    with_fresh_peer(scenario)


def test_a_batch_larger_than_the_assignment_is_refused() -> None:
    async def scenario(daemon: PeerDaemon, target: str) -> None:
        code, details = await exchange_status(target, good_frames(3, batch=64 * B))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)

    with_fresh_peer(scenario)


def test_an_undecodable_frame_is_invalid_argument() -> None:
    async def scenario(daemon: PeerDaemon, target: str) -> None:
        async with raw_channel(target) as channel:
            messages = [HELLO_FRAMES[0].SerializeToString(), b"\xff\xff\xff"]
            _, code, details, _ = await asyncio.wait_for(stream(channel, messages, raw=True), STREAM_TIMEOUT)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)

    with_fresh_peer(scenario)


def test_a_reply_outlives_its_replaced_link() -> None:
    """Regression (fixed in the daemon since): a forward whose link is replaced, and whose replacement
    ends, while it computes used to reply to ``daemon.upstream = None``: AttributeError, UNKNOWN status."""

    async def scenario(daemon: PeerDaemon, target: str) -> None:
        async with raw_channel(target) as channel:
            first = wgrpc.StageStub(channel).Link()
            for f in HELLO_FRAMES:
                await first.write(f)
            await asyncio.wait_for(first.read(), 10)  # the peer's hello: this link is the upstream now
            blocker = asyncio.ensure_future(daemon.run_compute(time.sleep, 1.0, priority=BACKWARD))  # first
            for f in good_frames(4)[len(HELLO_FRAMES) :]:
                await first.write(f)
            await asyncio.sleep(0.2)
            code, _ = await exchange_status(target, HELLO_FRAMES)  # a reconnect that ends at once
            assert code == grpc.StatusCode.OK
            await blocker
            await first.done_writing()
            with contextlib.suppress(grpc.aio.AioRpcError):
                while await asyncio.wait_for(first.read(), 10) is not grpc.aio.EOF:
                    pass
            code, details = await first.code(), await first.details()
        assert code != grpc.StatusCode.UNKNOWN, details

    with_fresh_peer(scenario)


def test_remote_text_is_not_logged_verbatim() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("peer.stage_service", "swarm.wire.transport", "peer.daemon")]

    async def scenario(daemon: PeerDaemon, target: str) -> None:
        evil = pb.Packet(refusal=pb.Refusal(mb_id=1, reason="ok\n[ERROR] coordinator: run finished\x1b[2J"))
        await exchange_status(target, HELLO_FRAMES + list(split_packet(evil, 1)))

    for lg in loggers:
        lg.addHandler(handler)
    try:
        with_fresh_peer(scenario)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert any("run finished" in m for m in messages), messages  # the refusal was logged ...
    assert not any("\n" in m or "\x1b" in m for m in messages), messages  # ... but not verbatim


def test_the_fuzz_target_serves_with_a_real_peers_auth_and_limits() -> None:
    """Issue 16 item 6: the target used to be a bare server; a stranger's call and a call flood prove it is not."""

    async def scenario(daemon: PeerDaemon, target: str) -> None:
        # A stranger (no proof) is refused as its call opens, before any frame is read. It writes nothing: a
        # write racing that refusal hits the grpc.aio client bug of MASKED_STATUS (seen once in CI, 2026-12-06).
        async with grpc.aio.insecure_channel(target) as stranger:
            call = wgrpc.StageStub(stranger).Link()
            code = await asyncio.wait_for(call.code(), STREAM_TIMEOUT)
            details = await call.details()
        assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
        codes = []
        async with raw_channel(target) as channel:  # a member over its call rate (burst 40), unpaced
            for _ in range(int(LimitSettings().call_burst) + 10):
                call = wgrpc.StageStub(channel).Link()
                await call.done_writing()  # an empty link: ends at once
                codes.append(await asyncio.wait_for(call.code(), STREAM_TIMEOUT))
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes

    with_fresh_peer(scenario)
