"""Swarm join-token auth on real grpc.aio servers on loopback, for every call shape Ravn uses."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from swarm.dht.signing import new_key
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.pb import wire_pb2 as pb
from swarm.pb import wire_pb2_grpc as wgrpc
from swarm.security import auth, identity
from swarm.security.identity import CallSigner
from swarm.security.nonces import NonceCache
from tests.security_helpers import link_roundtrip, serve

TOKEN = auth.generate_token()
OTHER = auth.generate_token()
LINK = "/ravn.wire.Stage/Link"
PROBE = "/ravn.control.Control/Probe"
KEY = new_key()  # this test process's record key
SIGNER = CallSigner(KEY)


def interceptors(token: str, peer: str, aud: str, **kw) -> list:
    return auth.client_interceptors(token, peer, aud, signer=KEY, **kw)


# ---- token and verifier, no network ---------------------------------------------------------------


def test_token_roundtrip_and_readable_refusals() -> None:
    assert len(auth.parse_token(TOKEN)) == auth.TOKEN_BYTES
    assert auth.parse_token(f"  {TOKEN}\n") == auth.parse_token(TOKEN)
    assert TOKEN != OTHER
    for bad, text in [
        ("hunter2", "must start with"),
        (TOKEN[:-5], "cut while copying"),
        (TOKEN[:-1] + "!", "not valid base64url"),
    ]:
        with pytest.raises(ValueError, match=text):
            auth.parse_token(bad)
    key = auth.SwarmKey.from_token(TOKEN)
    assert key.fingerprint not in TOKEN and "key=" not in repr(key)


def verifier(**kw) -> auth.Verifier:
    return auth.Verifier(TOKEN, **kw)


def proof(token: str = TOKEN, *, peer: str = "peer-a", aud: str = "peer-b", method: str = LINK, **kw):
    signer = kw.pop("signer", SIGNER)
    return auth.proof_metadata(auth.SwarmKey.from_token(token), peer, aud, method, signer=signer, **kw)


def refused(v: auth.Verifier, metadata, method: str = LINK) -> str:
    with pytest.raises(auth.AuthError) as e:
        v.verify(metadata, method)
    return str(e.value)


def test_verifier_accepts_a_valid_proof_once() -> None:
    v = verifier(audiences=["peer-b"])
    md = proof()
    assert v.verify(md, LINK) == "peer-a"
    assert "replayed" in refused(v, md)
    assert v.verify(proof(), LINK) == "peer-a"  # a fresh nonce is fine


def test_verifier_refusals_say_why() -> None:
    v = verifier(audiences=["peer-b"])
    assert "requires a join token" in refused(v, ())
    assert "missing ravn-sig" in refused(v, proof()[:-1])
    assert "missing ravn-mac, ravn-key" in refused(v, [(k, x) for k, x in proof() if k not in ("ravn-mac", "ravn-key")])
    assert "wrong join token" in refused(v, proof(OTHER))
    assert "wrong join token" in refused(v, proof(method=PROBE))  # a proof is bound to its method
    assert "not to this server" in refused(v, proof(aud="peer-c"))
    assert "stale proof" in refused(v, proof(now=time.time() - 3600))
    assert "stale proof" in refused(v, proof(now=time.time() + 3600))  # from the future
    md = list(proof())
    assert "more than once" in refused(v, md + [md[0]])
    tampered = [(k, "peer-z") if k == auth.META_PEER else (k, val) for k, val in proof()]
    assert "wrong join token" in refused(v, tampered)
    for key, value in [(auth.META_TS, "12a"), (auth.META_NONCE, "short"), (auth.META_MAC, "x" * 43 + "=")]:
        bad = [(k, value) if k == key else (k, val) for k, val in proof()]
        assert "malformed" in refused(v, bad)
    other = dict(proof(signer=CallSigner(new_key())))
    forged = [(k, other[k]) if k == identity.META_SIG else (k, x) for k, x in proof()]
    assert "does not verify" in refused(v, forged)  # a signature of other fields (or by another key)
    swapped = [(k, other[k]) if k == identity.META_KEY else (k, x) for k, x in proof()]
    assert "does not verify" in refused(v, swapped)  # our signature presented under another key
    assert v.refused == 15


def test_a_planned_peer_id_is_only_served_to_the_holder_of_its_key() -> None:
    """The signature turns the peer id into an identity where the plan pins that peer's key."""
    v = verifier(audiences=["peer-b"], keys={"peer-a": SIGNER.public_key}.get)
    assert v.verify(proof(), LINK) == "peer-a"
    with pytest.raises(auth.NotThatPeer, match="not signed by the key that peer announced") as e:
        v.verify(proof(signer=CallSigner(new_key())), LINK)  # a token holder with its own key, claiming peer-a
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert v.verify(proof(peer="peer-x", signer=CallSigner(new_key())), LINK) == "peer-x"  # unplanned: any key


def test_nonce_cache_expires_and_its_bound_cannot_be_used_to_replay() -> None:
    cache = NonceCache(skew_s=10, capacity=3)
    assert cache.add("n1", 1000, now=1.0) is None
    assert cache.add("n1", 1000, now=2.0) is not None
    assert cache.add("n1", 1000, now=22.0) is None  # after 2 * skew the stamp alone refuses a replay
    for i, ts in enumerate([2000, 3000, 4000]):
        assert cache.add(f"m{i}", ts, now=23.0) is None
    assert len(cache) == 3
    assert cache.floor_ms == 1000  # n1 was evicted: anything stamped at or before it is refused
    assert cache.add("n1", 1000, now=23.0) is not None
    assert cache.add("fresh", 5000, now=23.0) is None


def test_client_auth_rejects_names_that_cannot_travel_as_metadata() -> None:
    with pytest.raises(ValueError, match="peer id"):
        auth.ClientAuth(TOKEN, "bad id\n", "peer-b", signer=KEY)
    with pytest.raises(ValueError, match="audience"):
        auth.ClientAuth(TOKEN, "peer-a", "", signer=KEY)


# ---- real servers -----------------------------------------------------------------------------------


async def call_all_shapes(channel: grpc.aio.Channel, *, metadata=None) -> dict[str, grpc.StatusCode]:
    """One call of each shape; the status each ended with."""
    control, stage = cgrpc.ControlStub(channel), wgrpc.StageStub(channel)
    codes: dict[str, grpc.StatusCode] = {}

    async def frames():
        yield pb.Frame(packet_id=1, data=b"abc", last=True, total_size=3)

    async def attempt(name: str, coro) -> None:
        try:
            await asyncio.wait_for(coro, 10)
            codes[name] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            codes[name] = e.code()
            assert (
                e.code() != grpc.StatusCode.UNAUTHENTICATED or "join token" in e.details() or "proof" in e.details()
            ), e.details()

    async def join():
        return [c async for c in control.Join(cpb.JoinRequest(peer_id="a"), metadata=metadata)]

    async def link():
        call = stage.Link(metadata=metadata)
        await call.write(pb.Frame(packet_id=1, data=b"abc", last=True, total_size=3))
        reply = await call.read()
        if reply is grpc.aio.EOF:  # refused: read() ends the stream, code() says why
            raise grpc.aio.AioRpcError(await call.code(), None, None, await call.details())
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF

    await attempt("unary", control.Probe(cpb.ProbeRequest(payload=b"ab"), metadata=metadata))
    await attempt("server-stream", join())
    await attempt("client-stream", control.UploadState(frames(), metadata=metadata))
    await attempt("bidi", link())
    return codes


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


def test_calls_without_valid_proof_get_unauthenticated_and_never_reach_the_handler() -> None:
    async def scenario() -> None:
        v = auth.Verifier(TOKEN, audiences=["peer-b"])
        async with serve(interceptors=[auth.ServerAuth(v)]) as (target, stage, control):
            unauth = {k: grpc.StatusCode.UNAUTHENTICATED for k in ("unary", "server-stream", "client-stream", "bidi")}
            async with grpc.aio.insecure_channel(target) as ch:  # no proof at all
                assert await call_all_shapes(ch) == unauth
            wrong = interceptors(OTHER, "peer-a", "peer-b")
            async with grpc.aio.insecure_channel(target, interceptors=wrong) as ch:
                assert await call_all_shapes(ch) == unauth
            stale = interceptors(TOKEN, "peer-a", "peer-b", clock=lambda: time.time() - 3600)
            async with grpc.aio.insecure_channel(target, interceptors=stale) as ch:
                assert await call_all_shapes(ch) == unauth
            elsewhere = interceptors(TOKEN, "peer-a", "peer-c")
            async with grpc.aio.insecure_channel(target, interceptors=elsewhere) as ch:
                assert await call_all_shapes(ch) == unauth
            assert stage.calls == 0 and control.calls == 0
            assert v.refused == 16

    run(scenario())


def test_valid_proofs_pass_for_every_call_shape_and_link_keeps_write_read() -> None:
    async def scenario() -> None:
        v = auth.Verifier(TOKEN, audiences=["peer-b"])
        async with serve(interceptors=[auth.ServerAuth(v)]) as (target, stage, control):
            good = interceptors(TOKEN, "peer-a", "peer-b")
            async with grpc.aio.insecure_channel(target, interceptors=good) as ch:
                codes = await call_all_shapes(ch)
                assert set(codes.values()) == {grpc.StatusCode.OK}, codes
                frames = await link_roundtrip(ch, n=5)
                assert [f.packet_id for f in frames] == list(range(5))
                reply = await cgrpc.ControlStub(ch).Probe(cpb.ProbeRequest(payload=b"abc"))
                assert reply.payload == b"cba"
            assert stage.calls == 2 and control.calls == 4
            assert v.refused == 0 and len(v.nonces) == 6

    run(scenario())


def test_replayed_and_cross_method_proofs_are_refused_on_a_live_server() -> None:
    async def scenario() -> None:
        v = auth.Verifier(TOKEN)
        async with serve(interceptors=[auth.ServerAuth(v)]) as (target, stage, control):
            key = auth.SwarmKey.from_token(TOKEN)
            captured = auth.proof_metadata(key, "peer-a", "peer-b", PROBE, signer=SIGNER)
            async with grpc.aio.insecure_channel(target) as ch:
                stub = cgrpc.ControlStub(ch)
                assert (await stub.Probe(cpb.ProbeRequest(payload=b"x"), metadata=captured)).payload == b"x"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Probe(cpb.ProbeRequest(payload=b"x"), metadata=captured)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in e.value.details()
                # the same proof presented for the bidi stream: bound to Probe, so refused
                fresh = auth.proof_metadata(key, "peer-a", "peer-b", PROBE, signer=SIGNER)
                codes = await call_all_shapes(ch, metadata=fresh)
                assert codes["bidi"] == grpc.StatusCode.UNAUTHENTICATED
                # a replayed bidi proof
                link_proof = auth.proof_metadata(key, "peer-a", "peer-b", LINK, signer=SIGNER)
                call = wgrpc.StageStub(ch).Link(metadata=link_proof)
                await call.write(pb.Frame(packet_id=1, last=True))
                assert (await call.read()).packet_id == 1
                call.cancel()
                call = wgrpc.StageStub(ch).Link(metadata=link_proof)
                with contextlib.suppress(grpc.aio.AioRpcError):  # read() ends with EOF or raises
                    assert await call.read() is grpc.aio.EOF
                assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "replayed" in await call.details()
            assert stage.calls == 1

    run(scenario())


def test_exempt_methods_and_authenticated_peer() -> None:
    seen: list[str | None] = []

    class Recording(cgrpc.ControlServicer):
        async def Probe(self, request, context):  # noqa: N802
            seen.append(auth.authenticated_peer(context))
            return cpb.ProbeReply()

    async def scenario() -> None:
        v = auth.Verifier(TOKEN)
        server = grpc.aio.server(interceptors=[auth.ServerAuth(v, exempt=[PROBE])])
        cgrpc.add_ControlServicer_to_server(Recording(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                await cgrpc.ControlStub(ch).Probe(cpb.ProbeRequest())
            proving = interceptors(TOKEN, "peer-7", "coordinator")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=proving) as ch:
                await cgrpc.ControlStub(ch).Probe(cpb.ProbeRequest())
        finally:
            await server.stop(None)
        assert seen == [None, "peer-7"]

    run(scenario())


def test_the_synchronous_client_api_carries_the_proof_too() -> None:
    """``ravn status`` uses grpc's synchronous API."""

    def probe(target: str, token: str) -> grpc.StatusCode:
        with grpc.insecure_channel(target) as raw:
            channel = auth.sync_channel(raw, token, "operator", "coordinator")
            try:
                for i in range(2):  # a fresh nonce each call
                    reply = cgrpc.ControlStub(channel).Probe(cpb.ProbeRequest(payload=b"ab"), timeout=10)
                    assert reply.payload == b"ba", i
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()

    async def scenario() -> None:
        v = auth.Verifier(TOKEN, audiences=["coordinator"])
        async with serve(interceptors=[auth.ServerAuth(v)]) as (target, _, control):
            assert await asyncio.to_thread(probe, target, TOKEN) == grpc.StatusCode.OK
            assert await asyncio.to_thread(probe, target, OTHER) == grpc.StatusCode.UNAUTHENTICATED
            assert control.calls == 2

    run(scenario())
