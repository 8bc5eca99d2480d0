"""``ravn``: the swarm on your laptop (``ravn local``) and, later, a view of any swarm."""

from __future__ import annotations

import os
import re
from typing import Annotated

import typer
import uvloop

from coordinator.local_swarm import run_local
from coordinator.membership import Membership, MembershipSettings
from coordinator.options import RunOptions, with_train_options
from coordinator.swarm_run import RunSettings
from swarm.logs import setup_logging

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def _main() -> None:
    """Ravn: train transformers across many small machines."""


@app.command()
@with_train_options
def local(
    options: RunOptions,
    peers: Annotated[int, typer.Option(min=1, help="Peer processes to start (one pipeline stage each).")] = 3,
    threads: Annotated[int, typer.Option(min=0, help="Compute threads per peer (0: cores / peers).")] = 0,
    device: Annotated[str, typer.Option(help="'auto' (CUDA when present), 'cpu' or 'cuda'.")] = "auto",
    heartbeat: Annotated[float, typer.Option(min=0.2, help="Seconds between DHT announcements.")] = 2.0,
    debug_slow_peer: Annotated[str, typer.Option(hidden=True, help="Testing: INDEX:SECONDS slows one peer.")] = "",
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "WARNING",
) -> None:
    """Start a coordinator and PEERS peers on this machine and train the built-in GPT."""
    setup_logging(log_level)
    model = options.model_config()
    if peers > model.n_layers:
        raise typer.BadParameter(
            f"{options.model} has {model.n_layers} layers; use at most that many peers", param_hint="--peers"
        )
    name = options.run_name()
    swarm = "local-" + re.sub(r"[^a-z0-9_-]", "-", name.lower())[:26]
    run_dir = options.runs_dir / name
    settings = RunSettings(
        name=name,
        run_dir=run_dir,
        model=model,
        train=options.train_config(),
        peers=peers,
        model_name=options.model_name,
        swarm=swarm,
        hf=options.hf_config(),
    )
    threads = threads or max(1, (os.cpu_count() or 1) // peers)
    membership = Membership(MembershipSettings(swarm=swarm, key_file=run_dir / "coordinator.pem", heartbeat=heartbeat))
    membership.start()  # the same discovery path as a real swarm, on loopback
    try:
        code = uvloop.run(
            run_local(
                settings, membership, threads=threads, device=device, heartbeat=heartbeat, slow_peer=debug_slow_peer
            )
        )
    finally:
        membership.shutdown()
    raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
