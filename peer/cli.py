"""``ravn-peer``: run a peer on this machine and lend its GPU (or CPU) to a swarm."""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Annotated

import typer
import uvloop

from peer.daemon import PeerDaemon, PeerSettings
from swarm.lifecycle import die_with_parent_if_asked
from swarm.logs import setup_logging

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def _main() -> None:
    """Run a Ravn peer."""


@app.command()
def join(
    coordinator: Annotated[str, typer.Option(help="The coordinator's control address, HOST:PORT.")],
    name: Annotated[str, typer.Option(help="This peer's name in the swarm (default: hostname-pid).")] = "",
    host: Annotated[str, typer.Option(help="Address the stage service listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port of the stage service (0: any free).")] = 0,
    announce: Annotated[str, typer.Option(help="Address other peers dial to reach this one (default: --host); "
                                          "needed when listening on 0.0.0.0 or behind port forwarding.")] = "",
    device: Annotated[str, typer.Option(help="'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'.")] = "auto",
    threads: Annotated[int, typer.Option(min=0, help="CPU threads for compute (0: torch's default).")] = 0,
    step_timeout: Annotated[float, typer.Option(help="Seconds the data source waits for a step's gradients.")
                            ] = 300.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Join a swarm: serve the block of layers the coordinator assigns, until it says stop."""
    die_with_parent_if_asked()
    peer_id = name or f"{socket.gethostname()}-{__import__('os').getpid()}"
    setup_logging(log_level, prefix=f"[{peer_id}] ")
    if host in ("0.0.0.0", "::") and not announce:
        raise typer.BadParameter("listening on all interfaces: also pass --announce with the address "
                                 "other peers can reach (e.g. your LAN or public IP)", param_hint="--announce")
    settings = PeerSettings(coordinator=coordinator, peer_id=peer_id, host=host, port=port, announce=announce,
                            device=device, threads=threads, step_timeout=step_timeout)
    raise typer.Exit(uvloop.run(_serve(settings)))


async def _serve(settings: PeerSettings) -> int:
    daemon = PeerDaemon(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, daemon.stopping.set)
    return await daemon.run()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
