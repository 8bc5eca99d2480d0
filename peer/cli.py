"""Ravn peer: lend this machine's GPU (or CPU) to a swarm."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Annotated

import typer
import uvloop

from peer.daemon import PeerDaemon, PeerSettings
from peer.discovery import Discovery, DiscoveryError, DiscoverySettings
from peer.faults import POISON_MODES, Faults
from swarm.allocator import THP_ENV, active_allocator, exec_with_allocator
from swarm.config_file import enable_config
from swarm.lifecycle import die_with_parent_if_asked
from swarm.logs import setup_logging
from swarm.security.auth import parse_token
from swarm.security.tls import TlsError, TlsIdentity, identity_from_options
from swarm.sizes import parse_size

log = logging.getLogger(__name__)
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
DEFAULT_CONFIG = Path("~/.config/ravn/peer.toml").expanduser()


@app.callback()
def _main() -> None:
    """Run a Ravn peer."""


def _slow_stage(spec: str) -> tuple[int, float] | None:
    if not spec:
        return None
    try:
        stage, seconds = spec.split("=")
        return int(stage), float(seconds)
    except ValueError:
        raise typer.BadParameter("expected STAGE=SECONDS", param_hint="--debug-slow-stage") from None


def _memory(spec: str) -> int:
    if not spec:
        return 0
    try:
        size = parse_size(spec)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--memory") from None
    if size <= 0:
        raise typer.BadParameter("must be more than 0 bytes", param_hint="--memory")
    return size


def _crash_at(spec: str) -> tuple[int, int] | None:
    if not spec:
        return None
    try:
        stage, version = spec.split("=")
        return int(stage), int(version)
    except ValueError:
        raise typer.BadParameter("expected STAGE=VERSION", param_hint="--debug-crash-at-checkpoint") from None


@app.command()
def join(
    swarm: Annotated[str, typer.Option(envvar="RAVN_SWARM", help="Name of the swarm to join.")] = "",
    initial_peers: Annotated[
        list[str] | None,
        typer.Option(
            envvar="RAVN_INITIAL_PEERS",
            help="Multiaddr of a DHT node of the swarm (repeatable); printed by ravn-coordinator serve.",
        ),
    ] = None,
    swarm_token: Annotated[
        str,
        typer.Option(
            envvar="RAVN_SWARM_TOKEN",
            help="The swarm's join token (printed by ravn-coordinator serve); "
            "prefer the environment variable, which other users cannot read from the process list.",
        ),
    ] = "",
    coordinator_key: Annotated[
        str,
        typer.Option(
            envvar="RAVN_COORDINATOR_KEY", help="The coordinator's public key; only plans it signed are obeyed."
        ),
    ] = "",
    name: Annotated[str, typer.Option(help="This peer's name in the swarm (default: hostname-pid).")] = "",
    host: Annotated[str, typer.Option(help="Address the stage service and the DHT listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port of the stage service (0: any free).")] = 0,
    dht_port: Annotated[int, typer.Option(min=0, max=65535, help="Port of the DHT node (0: any free).")] = 0,
    announce: Annotated[
        str,
        typer.Option(
            help="Address other peers dial to reach this one (default: --host); "
            "needed when listening on 0.0.0.0 or behind port forwarding."
        ),
    ] = "",
    device: Annotated[str, typer.Option(help="'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'.")] = "auto",
    threads: Annotated[int, typer.Option(min=0, help="CPU threads for compute (0: torch's default).")] = 0,
    memory: Annotated[
        str,
        typer.Option(
            help="The most memory this peer offers the swarm, e.g. 20GiB (default: all it measures free "
            "on --device); announced instead of the measured free memory when smaller.",
        ),
    ] = "",
    heartbeat: Annotated[
        float, typer.Option(min=0.2, help="Seconds between DHT announcements (the record expires after 3).")
    ] = 5.0,
    step_timeout: Annotated[float, typer.Option(help="Seconds the data source waits for a step's gradients.")] = 300.0,
    find_timeout: Annotated[float, typer.Option(help="Seconds to look for the swarm's coordinator in the DHT.")] = 60.0,
    coordinator_grace: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Seconds to train on and redial when the coordinator is gone, so a restarted one can "
            "re-attach this peer (0: leave at once).",
        ),
    ] = 60.0,
    debug_slowdown: Annotated[float, typer.Option(hidden=True, help="Testing: extra seconds per micro-batch.")] = 0.0,
    debug_uplink_mbit: Annotated[
        float, typer.Option(hidden=True, min=0.0, help="Testing: announce this upload Mbit/s, not the measured one.")
    ] = 0.0,
    debug_slow_stage: Annotated[
        str, typer.Option(hidden=True, help="Testing: STAGE=SECONDS adds SECONDS per pass to that stage's holders.")
    ] = "",
    debug_poison: Annotated[
        str, typer.Option(hidden=True, help="Testing: 'scale' (x1e6) or 'nan' corrupts every training tensor sent.")
    ] = "",
    debug_crash_at_checkpoint: Annotated[
        str,
        typer.Option(
            hidden=True, help="Testing: STAGE=VERSION: that stage's holder dies instead of uploading that checkpoint."
        ),
    ] = "",
    debug_poison_after: Annotated[
        int, typer.Option(hidden=True, min=0, help="Testing: optimizer steps of the block before --debug-poison.")
    ] = 0,
    metrics_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="Serve Prometheus metrics on this port (0: any free).")
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address of the Prometheus endpoint.")] = "127.0.0.1",
    tls: Annotated[
        str,
        typer.Option(
            help="'off', or 'self-signed': serve the stage service over TLS with a fresh certificate whose "
            "fingerprint goes into this peer's DHT record and the signed plan; neighbours pin it."
        ),
    ] = "off",
    tls_cert: Annotated[
        Path | None, typer.Option(help="Serve the stage service over TLS with this PEM certificate (pinned too).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="The PEM private key of --tls-cert.")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Join a swarm: find it through the DHT, serve the block of layers its coordinator assigns."""
    die_with_parent_if_asked()
    peers = [p for item in (initial_peers or []) for p in str(item).replace(",", " ").split()]
    missing = [
        flag
        for flag, value in (
            ("--swarm", swarm),
            ("--initial-peers", peers),
            ("--coordinator-key", coordinator_key),
            ("--swarm-token", swarm_token),
        )
        if not value
    ]
    if missing:
        raise typer.BadParameter(
            f"missing {', '.join(missing)}: pass them as printed by `ravn-coordinator serve`, set RAVN_SWARM, "
            f"RAVN_INITIAL_PEERS, RAVN_COORDINATOR_KEY and RAVN_SWARM_TOKEN, or write them in {DEFAULT_CONFIG}",
            param_hint=missing[0],
        )
    if host in ("0.0.0.0", "::") and not announce:
        raise typer.BadParameter(
            "listening on all interfaces: also pass --announce with the address "
            "other peers can reach (e.g. your LAN or public IP)",
            param_hint="--announce",
        )
    try:
        parse_token(swarm_token)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--swarm-token") from None
    if debug_poison not in ("", *POISON_MODES):
        raise typer.BadParameter(f"use one of {', '.join(POISON_MODES)}", param_hint="--debug-poison")
    identity = _tls_identity(tls, tls_cert, tls_key)
    memory_limit = _memory(memory)
    peer_id = name or f"{socket.gethostname()}-{os.getpid()}"
    setup_logging(log_level, prefix=f"[{peer_id}] ")
    log.info("malloc: %s, huge pages: %s", active_allocator(), "on" if os.environ.get(THP_ENV) == "1" else "off")
    try:
        discovery = Discovery(
            DiscoverySettings(
                swarm=swarm,
                initial_peers=tuple(peers),
                coordinator_key=coordinator_key,
                heartbeat=heartbeat,
                find_timeout=find_timeout,
                dht_host=host,
                dht_port=dht_port,
            )
        )
    except (DiscoveryError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    settings = PeerSettings(
        peer_id=peer_id,
        host=host,
        port=port,
        announce=announce,
        device=device,
        threads=threads,
        memory_limit=memory_limit,
        step_timeout=step_timeout,
        coordinator_grace=coordinator_grace,
        swarm_token=swarm_token,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        tls=identity,
    )
    faults = Faults(
        slowdown=debug_slowdown,
        slow_stage=_slow_stage(debug_slow_stage),
        poison=debug_poison,
        poison_after=debug_poison_after,
        crash_at_checkpoint=_crash_at(debug_crash_at_checkpoint),
        uplink_mbit=debug_uplink_mbit,
    )
    raise typer.Exit(uvloop.run(_serve(PeerDaemon(settings, discovery, faults))))


def _tls_identity(mode: str, cert: Path | None, key: Path | None) -> TlsIdentity | None:
    """The stage service's TLS identity from the flags: a given certificate, a fresh self-signed one, or none."""
    try:
        return identity_from_options(mode, cert, key)
    except TlsError as e:
        raise typer.BadParameter(str(e), param_hint="--tls-cert" if cert or key else "--tls") from None


async def _serve(daemon: PeerDaemon) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, daemon.request_leave)
    return await daemon.run()


enable_config(app, sections={"join": "peer.join"}, default_file=DEFAULT_CONFIG)


def main() -> None:
    try:
        exec_with_allocator()  # jemalloc (or tcmalloc) when installed, and huge pages: swarm/allocator.py
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise SystemExit(2) from None
    app()


if __name__ == "__main__":
    main()
