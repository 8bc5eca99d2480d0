"""``ravn-peer``: lend this machine's GPU (or CPU) to a swarm."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import tomllib
from pathlib import Path
from typing import Annotated

import typer
import uvloop

from peer.daemon import PeerDaemon, PeerSettings
from peer.discovery import Discovery, DiscoveryError, DiscoverySettings
from swarm.lifecycle import die_with_parent_if_asked
from swarm.logs import setup_logging

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
DEFAULT_CONFIG = Path("~/.config/ravn/peer.toml").expanduser()


@app.callback()
def _main() -> None:
    """Run a Ravn peer."""


def _from_config(path: Path | None) -> dict:
    target = path or DEFAULT_CONFIG
    if not target.exists():
        if path is not None:
            raise typer.BadParameter(f"{path} does not exist", param_hint="--config")
        return {}
    try:
        return tomllib.loads(target.read_text())
    except (tomllib.TOMLDecodeError, OSError) as e:
        raise typer.BadParameter(f"cannot read {target}: {e}", param_hint="--config") from None


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
    coordinator_key: Annotated[
        str,
        typer.Option(
            envvar="RAVN_COORDINATOR_KEY", help="The coordinator's public key; only plans it signed are obeyed."
        ),
    ] = "",
    config: Annotated[
        Path | None,
        typer.Option(help=f"TOML file with swarm, initial_peers, coordinator_key (default {DEFAULT_CONFIG})."),
    ] = None,
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
    heartbeat: Annotated[
        float, typer.Option(min=0.2, help="Seconds between DHT announcements (the record expires after 3).")
    ] = 5.0,
    step_timeout: Annotated[float, typer.Option(help="Seconds the data source waits for a step's gradients.")] = 300.0,
    find_timeout: Annotated[float, typer.Option(help="Seconds to look for the swarm's coordinator in the DHT.")] = 60.0,
    debug_slowdown: Annotated[float, typer.Option(hidden=True, help="Testing: extra seconds per micro-batch.")] = 0.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Join a swarm: find it through the DHT, serve the block of layers its coordinator assigns."""
    die_with_parent_if_asked()
    file = _from_config(config)
    swarm = swarm or file.get("swarm", "")
    peers = [
        p for item in (initial_peers or file.get("initial_peers", [])) for p in str(item).replace(",", " ").split()
    ]
    coordinator_key = coordinator_key or file.get("coordinator_key", "")
    missing = [
        flag
        for flag, value in (("--swarm", swarm), ("--initial-peers", peers), ("--coordinator-key", coordinator_key))
        if not value
    ]
    if missing:
        raise typer.BadParameter(
            f"missing {', '.join(missing)}: pass them as printed by `ravn-coordinator serve`, set RAVN_SWARM, "
            f"RAVN_INITIAL_PEERS and RAVN_COORDINATOR_KEY, or write them in {DEFAULT_CONFIG}",
            param_hint=missing[0],
        )
    if host in ("0.0.0.0", "::") and not announce:
        raise typer.BadParameter(
            "listening on all interfaces: also pass --announce with the address "
            "other peers can reach (e.g. your LAN or public IP)",
            param_hint="--announce",
        )
    peer_id = name or f"{socket.gethostname()}-{os.getpid()}"
    setup_logging(log_level, prefix=f"[{peer_id}] ")
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
        step_timeout=step_timeout,
        slowdown=debug_slowdown,
    )
    raise typer.Exit(uvloop.run(_serve(PeerDaemon(settings, discovery))))


async def _serve(daemon: PeerDaemon) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, daemon.stopping.set)
    return await daemon.run()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
