"""TLS with self-signed certificates pinned by fingerprint, on real grpc.aio servers on loopback."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest

from swarm.dht.signing import new_key
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.security import auth, tls
from tests.security_helpers import link_roundtrip, serve

ID_A = tls.generate_self_signed()
ID_B = tls.generate_self_signed()


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


def test_fingerprints_are_stable_and_accept_openssl_spelling() -> None:
    fp = ID_A.fingerprint
    assert fp.startswith("sha256:") and len(fp) == 7 + 64
    assert tls.fingerprint(ID_A.cert_pem) == fp != ID_B.fingerprint
    hexpart = fp[7:]
    openssl = "sha256 Fingerprint=" + ":".join(hexpart[i : i + 2] for i in range(0, 64, 2)).upper()
    assert tls.normalise_fingerprint(openssl) == tls.normalise_fingerprint(hexpart) == fp
    with pytest.raises(tls.TlsError, match="64 hex"):
        tls.normalise_fingerprint("sha256:abc")
    assert "PRIVATE" not in repr(ID_A)
    assert tls.server_name(ID_A.cert_pem) == tls.DEFAULT_SERVER_NAME


def test_identity_files_roundtrip_and_mismatched_key_is_refused(tmp_path) -> None:
    cert, key = tmp_path / "peer.crt", tmp_path / "peer.key"
    first = tls.load_or_create_identity(cert, key)
    assert (key.stat().st_mode & 0o777) == 0o600
    assert tls.load_or_create_identity(cert, key).fingerprint == first.fingerprint  # stable across restarts
    (tmp_path / "other.key").write_bytes(ID_B.key_pem)
    with pytest.raises(tls.TlsError, match="does not belong"):
        tls.load_identity(cert, tmp_path / "other.key")
    (tmp_path / "junk.crt").write_bytes(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(tls.TlsError, match="not a PEM certificate"):
        tls.load_identity(tmp_path / "junk.crt", key)


def test_pinned_channel_works_for_unary_and_bidi_and_with_auth() -> None:
    token = auth.generate_token()

    async def scenario() -> None:
        add_port = functools.partial(tls.add_port, identity=ID_A)
        interceptors = [auth.ServerAuth(auth.Verifier(token))]
        async with serve(add_port=lambda s, a: add_port(s, a), interceptors=interceptors) as (target, stage, _):
            assert await tls.fetch_certificate(target) == ID_A.cert_pem
            proving = auth.client_interceptors(token, "peer-a", "peer-b", signer=new_key())
            channel = await tls.dial_pinned(target, ID_A.fingerprint, interceptors=proving)
            async with channel:
                assert (await cgrpc.ControlStub(channel).Probe(cpb.ProbeRequest(payload=b"ab"))).payload == b"ba"
                assert len(await link_roundtrip(channel, n=4)) == 4
            assert stage.calls == 1

    run(scenario())


def test_wrong_pin_impostor_and_cleartext_are_refused() -> None:
    async def scenario() -> None:
        add_port = functools.partial(tls.add_port, identity=ID_A)
        async with serve(add_port=lambda s, a: add_port(s, a)) as (target, stage, control):
            with pytest.raises(tls.TlsError, match="was expected"):
                await tls.dial_pinned(target, ID_B.fingerprint)
            # The dialler pinned B and somehow holds B's certificate, but the server is A (an impostor
            # at B's address): the gRPC handshake itself must fail.
            async with tls.pinned_channel(target, ID_B.cert_pem, ID_B.fingerprint) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await cgrpc.ControlStub(channel).Probe(cpb.ProbeRequest(), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await cgrpc.ControlStub(channel).Probe(cpb.ProbeRequest(), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert stage.calls == 0 and control.calls == 0
        with pytest.raises(tls.TlsError, match="handshake"):
            await tls.fetch_certificate(target, timeout=2)  # nobody listens there any more

    run(scenario())


def test_options_make_an_identity_and_a_kept_self_signed_one_survives_a_restart(tmp_path) -> None:
    assert tls.identity_from_options("off", None, None) is None
    fresh = tls.identity_from_options("self-signed", None, None)
    assert fresh is not None and fresh.fingerprint != tls.identity_from_options("self-signed", None, None).fingerprint
    kept = (tmp_path / "c.tls-cert.pem", tmp_path / "c.tls-key.pem")
    first = tls.identity_from_options("self-signed", None, None, keep_in=kept)
    assert tls.identity_from_options("self-signed", None, None, keep_in=kept) == first  # a restart keeps the pin
    assert kept[1].stat().st_mode & 0o077 == 0
    assert tls.identity_from_options("off", *kept).fingerprint == first.fingerprint  # given files win
    with pytest.raises(tls.TlsError, match="both --tls-cert and --tls-key"):
        tls.identity_from_options("off", kept[0], None)
    with pytest.raises(tls.TlsError, match="'off' or 'self-signed'"):
        tls.identity_from_options("on", None, None)


def test_the_synchronous_dialer_pins_too() -> None:
    def sync_client(target: str) -> None:  # `ravn status` has no event loop: it dials from a plain thread
        assert tls.fingerprint(tls.fetch_certificate_sync(target)) == ID_A.fingerprint
        assert tls.speaks_tls(target)
        with pytest.raises(tls.TlsError, match="was expected"):
            tls.dial_pinned_sync(target, ID_B.fingerprint)
        with tls.dial_pinned_sync(target, ID_A.fingerprint) as channel:
            assert cgrpc.ControlStub(channel).Probe(cpb.ProbeRequest(payload=b"ab"), timeout=10).payload == b"ba"

    async def scenario() -> None:
        add_port = functools.partial(tls.add_port, identity=ID_A)
        async with serve(add_port=lambda s, a: add_port(s, a)) as (target, _, control):
            await asyncio.to_thread(sync_client, target)
            assert control.calls == 1
        async with serve() as (target, _, _):
            assert not await asyncio.to_thread(tls.speaks_tls, target, 5)  # a cleartext server

    run(scenario())
