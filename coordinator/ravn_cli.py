"""Ravn: train transformers across many machines; `ravn local` runs a swarm here, `ravn status` watches one,
`ravn plan` predicts whether and how fast a set of PCs can fine-tune a checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import grpc
import typer
import uvloop
from rich.console import Console
from rich.live import Live

from coordinator.local_swarm import run_local
from coordinator.membership import Membership, MembershipSettings
from coordinator.option_checks import config_error
from coordinator.options import RunOptions, checked_configs, with_train_options
from coordinator.plan_command import plan
from coordinator.run_settings import RunSettings
from coordinator.status_data import SwarmStatus
from coordinator.status_verdict import exit_code, status_json, verdict
from coordinator.status_view import render, renderable
from swarm.allocator import preload_library
from swarm.config_file import enable_config
from swarm.dht.multiaddrs import multiaddr_to_grpc_target
from swarm.logs import setup_logging
from swarm.pb import control_pb2 as cpb
from swarm.pb import control_pb2_grpc as cgrpc
from swarm.security.auth import COORDINATOR_AUDIENCE, generate_token, sync_channel
from swarm.security.tls import dial_pinned_sync, normalise_fingerprint, speaks_tls
from swarm.sizes import parse_size
from swarm.wire.transport import GRPC_OPTIONS

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
    peer_memory: Annotated[
        str,
        typer.Option(
            help="The most memory each peer offers, e.g. 4GiB (ravn-peer join --memory; default: what it measures "
            "free). A model that does not fit ends the run with the memory needed and offered.",
        ),
    ] = "",
    heartbeat: Annotated[float, typer.Option(min=0.2, help="Seconds between DHT announcements.")] = 2.0,
    metrics_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="Serve the coordinator's Prometheus metrics on this port.")
    ] = None,
    debug_slow_peer: Annotated[str, typer.Option(hidden=True, help="Testing: INDEX:SECONDS slows one peer.")] = "",
    debug_slow_stage: Annotated[
        str, typer.Option(hidden=True, help="Testing: STAGE=SECONDS makes whoever holds that stage slower.")
    ] = "",
    debug_poison_peer: Annotated[
        str, typer.Option(hidden=True, help="Testing: INDEX:MODE:STEPS poisons one peer (ravn-peer --debug-poison).")
    ] = "",
    debug_crash_at_checkpoint: Annotated[
        str, typer.Option(hidden=True, help="Testing: STAGE=VERSION (ravn-peer --debug-crash-at-checkpoint).")
    ] = "",
    debug_slow_uplink: Annotated[
        str,
        typer.Option(
            hidden=True,
            help="Testing: INDEX:MBIT[,INDEX:MBIT], those peers announce that uplink (--debug-uplink-mbit).",
        ),
    ] = "",
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "WARNING",
) -> None:
    """Start a coordinator and PEERS peers on this machine and train the built-in GPT."""
    setup_logging(log_level)
    model, hf = checked_configs(options)  # a mistake is one line, before any process starts
    if options.data != "stdlib" and not Path(options.data).expanduser().exists():  # the peers read it here
        config_error(f"--data {options.data}: no such file or folder")
    try:
        preload_library()  # RAVN_ALLOCATOR, read here so that a typo is one line and not every peer's traceback
    except ValueError as e:
        config_error(str(e))
    if peer_memory:
        try:
            if parse_size(peer_memory) <= 0:
                raise ValueError("must be more than 0 bytes")
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--peer-memory") from None
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
        stages=options.stages,
        replicate=options.replicate,
        model_name=options.model_name,
        swarm=swarm,
        hf=hf,
        metrics_port=metrics_port,
        swarm_token=generate_token(),  # one per run; peers get it in their environment
    )
    threads = threads or max(1, (os.cpu_count() or 1) // peers)
    membership = Membership(MembershipSettings(swarm=swarm, key_file=run_dir / "coordinator.pem", heartbeat=heartbeat))
    membership.start()  # the same discovery path as a real swarm, on loopback
    try:
        code = uvloop.run(
            run_local(
                settings,
                membership,
                threads=threads,
                device=device,
                heartbeat=heartbeat,
                slow_peer=debug_slow_peer,
                slow_stage=debug_slow_stage,
                poison_peer=debug_poison_peer,
                crash_at_checkpoint=debug_crash_at_checkpoint,
                peer_memory=peer_memory,
                slow_uplink=debug_slow_uplink,
            )
        )
    finally:
        membership.shutdown()
    raise typer.Exit(code)


@app.command()
def status(
    coordinator: Annotated[
        str, typer.Option(help="The coordinator's control address (HOST:PORT or a multiaddr).")
    ] = "127.0.0.1:31337",
    json_output: Annotated[bool, typer.Option("--json", help="Print the status as JSON, for scripts.")] = False,
    watch: Annotated[bool, typer.Option(help="Redraw live until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between redraws with --watch.")] = 2.0,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the coordinator.")] = 5.0,
    swarm_token: Annotated[str, typer.Option(help="The swarm's join token (or RAVN_SWARM_TOKEN).")] = "",
    tls_fingerprint: Annotated[
        str,
        typer.Option(
            help="The coordinator serves TLS with this certificate (printed by ravn-coordinator serve); "
            "anything else is refused.",
        ),
    ] = "",
) -> None:
    """Show a swarm's health: verdict, run progress, every peer and block. Exit code 0/1/2: healthy/degraded/broken."""
    target = multiaddr_to_grpc_target(coordinator) if coordinator.startswith("/") else coordinator
    try:
        pin = normalise_fingerprint(tls_fingerprint) if tls_fingerprint else ""
        snapshot = fetch_status(target, timeout, swarm_token, pin)
        if json_output:
            typer.echo(json.dumps(status_json(snapshot), indent=2))
            raise typer.Exit(exit_code(verdict(snapshot)))
        console = Console()
        if not watch:
            render(snapshot, console)
            raise typer.Exit(exit_code(verdict(snapshot)))
        watch_until_ctrl_c(
            lambda: renderable(fetch_status(target, timeout, swarm_token, pin)), snapshot, interval, console
        )
        raise typer.Exit(0)
    except (grpc.RpcError, ValueError) as e:  # TlsError is a ValueError
        detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE and not pin and speaks_tls(target):
            detail = "it serves TLS; pass --tls-fingerprint as printed by ravn-coordinator serve"
        typer.echo(f"error: cannot read the status of the coordinator at {target}: {detail}", err=True)
        raise typer.Exit(3) from None
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def watch_until_ctrl_c(draw: Callable[[], object], first: SwarmStatus, interval: float, console: Console) -> None:
    """Redraw ``draw()`` every ``interval`` s until Ctrl-C; an in-flight fetch finishes first (``--timeout``).

    Ctrl-C only sets a flag: a KeyboardInterrupt raised at an arbitrary point could land inside rich's
    redraw lock or a gRPC call, and then the exit waited forever on the redraw thread (seen in CI under load).
    """
    stopped = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stopped.set())
    try:
        with Live(renderable(first), console=console, refresh_per_second=4) as live:
            while not stopped.is_set():
                deadline = time.monotonic() + interval
                while not stopped.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not stopped.is_set():
                    live.update(draw())
    finally:
        signal.signal(signal.SIGINT, previous)


def fetch_status(target: str, timeout: float, swarm_token: str = "", tls_fingerprint: str = "") -> SwarmStatus:
    """One status snapshot; over TLS pinned to ``tls_fingerprint`` when given (TlsError if it does not match)."""
    if tls_fingerprint:
        raw = dial_pinned_sync(target, tls_fingerprint, options=GRPC_OPTIONS, timeout=timeout)
    else:
        raw = grpc.insecure_channel(target, options=GRPC_OPTIONS)
    with raw:
        channel = sync_channel(raw, swarm_token, "operator", COORDINATOR_AUDIENCE) if swarm_token else raw
        reply = cgrpc.ControlStub(channel).Status(cpb.StatusRequest(), timeout=timeout)
    return SwarmStatus.from_dict(json.loads(reply.status_json))


app.command(name="plan")(plan)
enable_config(app, sections={"local": "local", "status": "status"})


def main() -> None:
    app()


if __name__ == "__main__":
    main()
