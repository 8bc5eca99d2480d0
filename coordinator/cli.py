"""``ravn-coordinator``: host the coordinator of a swarm that peers join over the network."""

from __future__ import annotations

import asyncio
import signal
from typing import Annotated

import typer
import uvloop

from coordinator.options import RunOptions, with_train_options
from coordinator.swarm_run import RunSettings, SwarmRun
from swarm.logs import setup_logging

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def _main() -> None:
    """Host a Ravn coordinator."""


@app.command()
@with_train_options
def serve(
    options: RunOptions,
    peers: Annotated[int, typer.Option(min=1, help="Number of peers to wait for before training starts.")] = 3,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 to accept peers from the network).")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Control port (0: any free port).")] = 31337,
    join_timeout: Annotated[float, typer.Option(help="Seconds to wait for all peers to join.")] = 600.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "WARNING",
) -> None:
    """Wait for PEERS peers, split the model among them, train, and write the run's artefacts."""
    setup_logging(log_level)
    name = options.run_name()
    settings = RunSettings(name=name, run_dir=options.runs_dir / name, model=options.model_config(),
                           train=options.train_config(), peers=peers, host=host, port=port,
                           join_timeout=join_timeout, model_name=options.model)
    raise typer.Exit(uvloop.run(_serve(settings)))


async def _serve(settings: RunSettings) -> int:
    run = SwarmRun(settings)
    port = await run.start_server()
    shown = "THIS-HOST" if settings.host in ("0.0.0.0", "::") else settings.host
    run.progress.message(f"coordinator listening on {settings.host}:{port}; waiting for {settings.peers} peers")
    run.progress.message(f"on each peer run:  ravn-peer join --coordinator {shown}:{port}"
                         + (" --host 0.0.0.0 --announce PEER-ADDRESS" if shown == "THIS-HOST" else ""))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, run.request_stop)
    try:
        return await run.run()
    finally:
        await run.stop_server()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
