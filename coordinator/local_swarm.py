"""``ravn local``: a whole swarm on one machine — this process coordinates, N peer processes train.

The peers are real OS processes talking gRPC over loopback, exactly as they would across the
internet. Every child is tied to this process (its own session, plus a parent-death signal it
arms itself on Linux), so Ctrl-C or a crash here leaves no orphan behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from coordinator.membership import Membership
from coordinator.run_settings import RunSettings
from coordinator.swarm_run import SwarmRun
from swarm.allocator import peer_environment
from swarm.lifecycle import DIE_WITH_PARENT_ENV

log = logging.getLogger(__name__)


@dataclass
class PeerProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path


def spawn_peer(
    name: str, join_args: list[str], log_dir: Path, threads: int, device: str, token: str = ""
) -> PeerProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "peer.cli",
        "join",
        *join_args,
        "--name",
        name,
        "--threads",
        str(threads),
        "--device",
        device,
    ]
    out = log_path.open("w")
    env = peer_environment(  # jemalloc (or tcmalloc) and huge pages under the peer (swarm/allocator.py)
        {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(max(threads, 1)),
            DIE_WITH_PARENT_ENV: str(os.getpid()),
            "RAVN_SWARM_TOKEN": token,
        }
    )
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    out.close()
    return PeerProcess(name, proc, log_path)


def stop_processes(peers: list[PeerProcess], grace: float = 15.0) -> None:
    """Wait for peers to leave on their own, then SIGTERM, then SIGKILL: nothing survives."""
    deadline = time.monotonic() + grace
    for p in peers:
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.proc.terminate()
    deadline = time.monotonic() + 5.0
    for p in peers:
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()


async def run_local(
    settings: RunSettings,
    membership: Membership,
    *,
    threads: int,
    device: str,
    heartbeat: float,
    slow_peer: str = "",
    slow_stage: str = "",
    poison_peer: str = "",
    crash_at_checkpoint: str = "",
    peer_memory: str = "",
    slow_uplink: str = "",
) -> int:
    """Coordinate a run with ``settings.peers`` local peer processes; returns the exit code."""
    run = SwarmRun(settings, membership)
    port = await run.start_server()
    token_file = settings.run_dir / "swarm.token"
    token_file.write_text(settings.swarm_token + "\n")
    token_file.chmod(0o600)
    run.progress.message(
        f"coordinator on 127.0.0.1:{port}, swarm {settings.swarm!r}; run {settings.name} in {settings.run_dir}"
    )
    run.progress.message(f"watch it: RAVN_SWARM_TOKEN=$(cat {token_file}) ravn status --coordinator 127.0.0.1:{port}")
    if settings.hf is not None and device in ("cpu", "auto"):
        import torch

        from swarm.train.hf.measure import cpu_dtype_hint

        on_cpu = device == "cpu" or not torch.cuda.is_available()  # 'auto' as the peers resolve it
        if on_cpu and (hint := await asyncio.to_thread(cpu_dtype_hint, settings.hf.dtype)):
            run.progress.message(f"note: {hint}")
    join_args = ["--swarm", settings.swarm, "--coordinator-key", membership.public_key, "--heartbeat", str(heartbeat)]
    join_args += ["--memory", peer_memory] if peer_memory else []
    for maddr in membership.maddrs():
        join_args += ["--initial-peers", maddr]
    loop = asyncio.get_running_loop()
    interrupts = 0

    def on_signal() -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            run.request_stop()
        else:
            for p in peers:
                p.proc.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    peers: list[PeerProcess] = []
    watcher = None
    try:
        for i in range(settings.peers):
            extra = ["--debug-slowdown", slow_peer.split(":")[1]] if slow_peer.startswith(f"{i}:") else []
            extra += ["--debug-slow-stage", slow_stage] if slow_stage else []
            extra += ["--debug-crash-at-checkpoint", crash_at_checkpoint] if crash_at_checkpoint else []
            for spec in slow_uplink.split(","):  # INDEX:MBIT[,INDEX:MBIT...]
                if spec.startswith(f"{i}:"):
                    extra += ["--debug-uplink-mbit", spec.split(":")[1]]
            if poison_peer.startswith(f"{i}:"):  # INDEX:MODE:STEPS
                _, mode, after = poison_peer.split(":")
                extra += ["--debug-poison", mode, "--debug-poison-after", after]
            peers.append(
                spawn_peer(
                    f"peer-{i}", join_args + extra, settings.run_dir / "logs", threads, device, settings.swarm_token
                )
            )
        run.progress.message(f"started {len(peers)} peers; logs in {settings.run_dir / 'logs'}")
        watcher = asyncio.create_task(_watch(peers, run))
        code = await run.run()
    finally:
        if watcher is not None:
            watcher.cancel()
        await run.stop_server()
        # peers that never trained (no plan fitted them) wait for one: nothing to let them finish
        await asyncio.to_thread(stop_processes, peers, 15.0 if run.flow.started else 1.0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return code


async def _watch(peers: list[PeerProcess], run: SwarmRun) -> None:
    """A peer process that dies is reported once, with the place to look."""
    reported: set[str] = set()
    while True:
        for p in peers:
            rc = p.proc.poll()
            if rc is not None and rc != 0 and p.name not in reported:
                reported.add(p.name)
                tail = p.log_path.read_text(errors="replace").strip().splitlines()[-1:]
                run.peer_failed(p.name, f"{p.name} exited with code {rc}; see {p.log_path}: " + " | ".join(tail))
        await asyncio.sleep(0.5)
