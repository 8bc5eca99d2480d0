"""Ravn coordinator: host the coordinator of a swarm that peers join over the network."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Annotated

import typer
import uvloop
from hivemind.p2p import P2PDaemonError

from coordinator.membership import Membership, MembershipSettings
from coordinator.options import RunOptions, checked_configs, with_train_options
from coordinator.run_settings import RunSettings, settings_record
from coordinator.run_state import CoordinatorState, StateError, forget_run, load_state, settings_diff, state_path
from coordinator.swarm_run import SwarmRun
from swarm.config_file import enable_config, remove_join_file, write_join_file
from swarm.dht.node import DHTStartError
from swarm.logs import setup_logging
from swarm.security.auth import load_or_create_token, parse_token
from swarm.security.tls import TlsError, TlsIdentity, identity_from_options

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def _main() -> None:
    """Host a Ravn coordinator."""


@app.command()
@with_train_options
def serve(
    options: RunOptions,
    peers: Annotated[int, typer.Option(min=1, help="Number of peers to wait for before training starts.")] = 3,
    host: Annotated[
        str, typer.Option(help="Address to listen on (0.0.0.0 to accept peers from the network).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Control port (0: any free port).")] = 31337,
    dht_port: Annotated[int, typer.Option(min=0, max=65535, help="DHT port (0: any free port).")] = 31338,
    swarm: Annotated[str, typer.Option(help="Swarm name: peers join with the same --swarm.")] = "ravn",
    announce: Annotated[str, typer.Option(help="Public address of this machine, when it differs from --host.")] = "",
    key_file: Annotated[
        Path | None,
        typer.Option(
            help="The coordinator's signing key (created if missing; "
            "default RUNS_DIR/SWARM.coordinator.pem). Keep it to restart "
            "without re-pinning peers."
        ),
    ] = None,
    heartbeat: Annotated[float, typer.Option(min=0.2, help="Seconds between membership checks.")] = 5.0,
    join_timeout: Annotated[float, typer.Option(help="Seconds to wait for all peers to join.")] = 600.0,
    join_file: Annotated[
        Path | None,
        typer.Option(
            help="Write the join values (swarm, DHT multiaddrs, public key) as TOML once listening; "
            "removed at start and exit. Peers can use it as `ravn-peer join --config FILE`."
        ),
    ] = None,
    swarm_token: Annotated[
        str,
        typer.Option(help="The swarm's join token (default: kept in RUNS_DIR/SWARM.token, created if missing)."),
    ] = "",
    metrics_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="Serve Prometheus metrics on this port (0: any free).")
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address of the Prometheus endpoint.")] = "127.0.0.1",
    fresh: Annotated[
        bool,
        typer.Option(
            help="Start run NAME over: forget its saved coordinator state and block checkpoints "
            "(without it, a run whose state is on disk resumes)."
        ),
    ] = False,
    tls: Annotated[
        str,
        typer.Option(
            help="'off', or 'self-signed': serve the control service over TLS with a certificate kept next to "
            "--key-file (created if missing); its fingerprint goes into the signed plan, and every peer pins it."
        ),
    ] = "off",
    tls_cert: Annotated[
        Path | None, typer.Option(help="Serve the control service over TLS with this PEM certificate (pinned too).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="The PEM private key of --tls-cert.")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "WARNING",
) -> None:
    """Wait for PEERS peers, split the model among them, train, and write the run's artefacts.

    A run started with --name resumes after a coordinator restart: the same command picks up its plan
    and step count from RUNS_DIR/NAME, and the peers, which train on meanwhile, re-attach.
    """
    setup_logging(log_level)
    model, hf = checked_configs(options)  # a mistake is one line, before the DHT starts or --fresh forgets
    if host in ("0.0.0.0", "::") and not announce:
        raise typer.BadParameter(
            "listening on all interfaces: also pass --announce with the address peers can reach",
            param_hint="--announce",
        )
    try:
        token = swarm_token or load_or_create_token(options.runs_dir / f"{swarm}.token")
        parse_token(token)
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e), param_hint="--swarm-token") from None
    name = options.run_name()
    if fresh:
        forget_run(options.runs_dir / name)
    try:
        saved = load_state(options.runs_dir / name)
        if saved is not None:
            port, dht_port = _resume_ports(saved, port, dht_port)
    except StateError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    key_file = key_file or options.runs_dir / f"{swarm}.coordinator.pem"
    try:
        identity = _tls_identity(tls, tls_cert, tls_key, key_file, saved)
    except (TlsError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    settings = RunSettings(
        swarm_token=token,
        name=name,
        run_dir=options.runs_dir / name,
        model=model,
        train=options.train_config(),
        peers=peers,
        stages=options.stages,
        replicate=options.replicate,
        host=host,
        port=port,
        announce=announce,
        join_timeout=join_timeout,
        model_name=options.model_name,
        swarm=swarm,
        hf=hf,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        tls=identity,
        wait_for_fit=True,  # peers can still join, or come back offering more memory
    )
    if saved is not None:
        diffs = settings_diff(saved.settings, settings_record(settings))
        if diffs:
            typer.echo(
                f"error: run {name!r} was started with other settings ({'; '.join(diffs[:5])}); restart it with "
                "the same flags, pick another --name, or pass --fresh to start it over",
                err=True,
            )
            raise typer.Exit(2)
        typer.echo(
            f"resuming run {name!r} from {state_path(settings.run_dir)} "
            f"({saved.last_step + 1} steps done; --fresh starts it over)"
        )
    if join_file is not None:
        remove_join_file(join_file)  # a stale one names a DHT identity that no longer exists
    try:
        membership = Membership(
            MembershipSettings(
                swarm=swarm,
                key_file=key_file,
                identity_file=key_file.with_suffix(".p2p-identity"),
                host=host,
                dht_port=dht_port,
                announce_host=announce,
                heartbeat=heartbeat,
            )
        )
        membership.start()  # forks the DHT process: before any gRPC thread exists
    except (ValueError, OSError, P2PDaemonError, DHTStartError) as e:
        typer.echo(f"error: {str(e).splitlines()[0]}", err=True)
        raise typer.Exit(2) from None
    try:
        raise typer.Exit(uvloop.run(_serve(settings, membership, join_file, saved)))
    finally:
        membership.shutdown()
        if join_file is not None:
            remove_join_file(join_file)


def tls_paths(key_file: Path) -> tuple[Path, Path]:
    """Where ``--tls self-signed`` keeps the Control certificate and its key: next to the signing key."""
    return key_file.with_suffix(".tls-cert.pem"), key_file.with_suffix(".tls-key.pem")


def _tls_identity(
    mode: str, cert: Path | None, key: Path | None, key_file: Path, saved: CoordinatorState | None
) -> TlsIdentity | None:
    """The Control service's TLS identity; a resumed run must present the certificate its plan pins."""
    identity = identity_from_options(mode, cert, key, keep_in=tls_paths(key_file))
    if saved is not None and saved.plan is not None:
        pinned, now = saved.plan.get("coordinator_tls_fingerprint", ""), identity.fingerprint if identity else ""
        if pinned != now:
            raise TlsError(
                f"run {saved.run_id!r} was started {f'with TLS certificate {pinned}' if pinned else 'in clear'} "
                f"and its peers pin that, but this start {f'presents {now}' if now else 'has no TLS'}; "
                "restart it with the same --tls options, or pass --fresh to start it over"
            )
    return identity


def join_command(run: SwarmRun, membership: Membership) -> str:
    peers = " ".join(f"--initial-peers {m}" for m in membership.maddrs())
    extra = " --host 0.0.0.0 --announce PEER-ADDRESS" if run.s.host in ("0.0.0.0", "::") else ""
    return (
        f"RAVN_SWARM_TOKEN={run.s.swarm_token} ravn-peer join --swarm {membership.s.swarm} {peers} "
        f"--coordinator-key {membership.public_key}{extra}"
    )


def _resume_ports(saved: CoordinatorState, port: int, dht_port: int) -> tuple[int, int]:
    """A resumed run listens where its peers redial: the control port in its plan, the DHT port they know."""
    if saved.finished:
        raise StateError(f"run {saved.run_id!r} already finished; pick another --name, or --fresh to train it again")
    for flag, given, kept in (("--port", port, saved.port), ("--dht-port", dht_port, saved.dht_port)):
        if given not in (0, kept):
            raise StateError(
                f"run {saved.run_id!r} listened on {flag} {kept} and its peers redial that; "
                f"restart it with {flag} {kept} (or 0), or pass --fresh to start it over"
            )
    return saved.port, saved.dht_port


async def _serve(
    settings: RunSettings, membership: Membership, join_file: Path | None = None, saved: CoordinatorState | None = None
) -> int:
    run = SwarmRun(settings, membership, resume=saved)
    port = await run.start_server()
    run.progress.message(
        f"coordinator of swarm {settings.swarm!r} on {settings.host}:{port} "
        f"(key {membership.fingerprint}); DHT at {' '.join(membership.maddrs())}"
    )
    if settings.tls is not None:
        run.progress.message(
            f"control service over TLS, certificate {settings.tls.fingerprint} (peers pin it from the signed plan); "
            f"ravn status --coordinator {settings.announce or settings.host}:{port} "
            f"--tls-fingerprint {settings.tls.fingerprint}"
        )
    run.progress.message(f"waiting for {settings.peers} peers; on each peer run:")
    run.progress.message(f"  {join_command(run, membership)}")
    if join_file is not None:
        try:
            write_join_file(
                join_file,
                swarm=settings.swarm,
                initial_peers=membership.maddrs(),
                coordinator_key=membership.public_key,
                swarm_token=settings.swarm_token,
                comment=f"swarm {settings.swarm}, coordinator key {membership.fingerprint}",
            )
        except OSError as e:
            run.progress.message(f"error: cannot write the join file {join_file}: {e}")
            await run.stop_server()
            return 2
        run.progress.message(f"join values written to {join_file}")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, run.request_stop)
    try:
        return await run.run()
    finally:
        await run.stop_server()


enable_config(app, sections={"serve": "coordinator.serve"})


def main() -> None:
    app()


if __name__ == "__main__":
    main()
