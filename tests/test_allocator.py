"""Peers run on jemalloc (or tcmalloc) where installed, not on glibc's malloc (swarm/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm import allocator
from swarm.allocator import peer_environment, preload_library
from swarm.security.auth import generate_token

ROOT = Path(__file__).resolve().parents[1]
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")

# Activations of 8-15 MiB, each freed while a small tensor allocated after it lives on: under glibc the
# freed buffers stay resident below the live ones (153 MiB of peak growth for at most 18 MiB live).
_HOLES = """
import torch
from swarm.allocator import active_allocator, release_free_memory
from swarm.train.memory import proc_status, reset_peak
MiB = 1 << 20
torch.ones(1)
release_free_memory()
reset_peak()
before = proc_status()["VmRSS"]
keep = []
for i in range(48):
    a = torch.ones((8 + i % 8) * MiB // 4)
    keep.append(torch.ones(64 * 1024 // 4))
    del a
print(active_allocator(), (proc_status()["VmHWM"] - before) / MiB)
"""


def _needs_an_allocator() -> str:
    lib = preload_library({})
    if lib is None:
        pytest.skip("neither jemalloc nor tcmalloc is installed (apt-get install libjemalloc2)")
    return lib


def test_a_preload_the_user_set_stays_and_system_keeps_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: f"lib{name}.so.9")
    assert peer_environment({})["LD_PRELOAD"] == "libjemalloc.so.9"
    assert peer_environment({"RAVN_ALLOCATOR": "tcmalloc"})["LD_PRELOAD"] == "libtcmalloc_minimal.so.9"
    assert peer_environment({"LD_PRELOAD": "/opt/mine.so"})["LD_PRELOAD"] == "/opt/mine.so"
    assert "LD_PRELOAD" not in peer_environment({"RAVN_ALLOCATOR": "system"})
    with pytest.raises(ValueError, match="RAVN_ALLOCATOR='glib': use one of auto, jemalloc, tcmalloc, system"):
        peer_environment({"RAVN_ALLOCATOR": "glib"})


def test_no_allocator_installed_adds_only_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    assert peer_environment({"A": "1"}) == {"A": "1", "THP_MEM_ALLOC_ENABLE": "1"}


def test_peers_get_huge_pages_unless_the_user_said_otherwise() -> None:
    """docs/codecs.md: half of a large decode was page faults, which PyTorch's huge pages remove."""
    assert peer_environment({"RAVN_ALLOCATOR": "system"})["THP_MEM_ALLOC_ENABLE"] == "1"
    assert peer_environment({"RAVN_ALLOCATOR": "system", "THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"


@linux
def test_a_peers_freed_activations_do_not_stay_resident() -> None:
    _needs_an_allocator()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LD_PRELOAD", None)
    runs = {}
    for name, base in (("peer", peer_environment(env)), ("system", {**env, "RAVN_ALLOCATOR": "system"})):
        out = subprocess.run([sys.executable, "-c", _HOLES], env=base, capture_output=True, text=True, check=True)
        who, peak = out.stdout.split()
        runs[name] = (who, float(peak))
    assert runs["system"][0] == "glibc"
    assert runs["peer"][0] in ("jemalloc", "tcmalloc"), runs
    assert runs["peer"][1] < 64, runs  # at most 18 MiB live; measured 18.5 jemalloc, 49 tcmalloc, 153 glibc


@linux
def test_a_peer_started_by_hand_runs_on_the_allocator() -> None:
    lib = _needs_an_allocator()
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("RAVN_ALLOCATOR", None)
    expected = "jemalloc" if "jemalloc" in lib else "tcmalloc"
    assert f"malloc: {expected}" in _join_by_hand(env).stderr


def _join_by_hand(env: dict[str, str]) -> subprocess.CompletedProcess:
    """``ravn-peer join`` as a user types it, refused at its coordinator key after it has started logging."""
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"
    proc = subprocess.run(
        [sys.executable, "-m", "peer.cli", "join", "--swarm", "s", "--initial-peers", unreachable]
        + ["--coordinator-key", "nonsense", "--swarm-token", generate_token()],
        cwd=ROOT,
        env={**env, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "--coordinator-key is not a public key" in proc.stderr, proc.stderr
    return proc


@linux
def test_a_peer_started_by_hand_runs_on_huge_pages_as_ravn_locals_do() -> None:
    env = {**os.environ, "RAVN_ALLOCATOR": "system"}  # no allocator needed: the huge pages alone
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    env.pop("LD_PRELOAD", None)
    assert "huge pages: on" in _join_by_hand(env).stderr
    assert "huge pages: off" in _join_by_hand({**env, "THP_MEM_ALLOC_ENABLE": "0"}).stderr


def test_a_wrong_allocator_name_is_one_line_for_the_peer_and_ravn_local() -> None:
    env = {**os.environ, "RAVN_ALLOCATOR": "glib", "COLUMNS": "400"}
    for cmd in (["peer.cli", "join", "--swarm", "s"], ["coordinator.ravn_cli", "local", "--steps", "1"]):
        proc = subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "error: RAVN_ALLOCATOR='glib': use one of" in proc.stderr, proc.stderr


_BUILDING = """
import sys, torch
from swarm.allocator import active_allocator, hold_freed_memory
from swarm.train.memory import proc_status
torch.ones(1)
hold_freed_memory(sys.argv[1] == "hold")
x = [torch.ones(1 << 16) for _ in range(128)]  # 32 MiB in 256 KiB tensors (jemalloc unmaps 8 MiB ones at once)
before = proc_status()["VmRSS"]
del x
print(active_allocator(), (before - proc_status()["VmRSS"]) / (1 << 20))
"""


@linux
def test_while_a_block_is_built_freed_memory_goes_back_at_once() -> None:
    _needs_an_allocator()
    env = peer_environment({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"PYTHONPATH": str(ROOT)})
    returned = {}
    for mode in ("build", "hold"):
        out = subprocess.run(
            [sys.executable, "-c", _BUILDING, mode], env=env, capture_output=True, text=True, check=True
        )
        who, mib = out.stdout.split()
        returned[mode] = float(mib)
    assert who in ("jemalloc", "tcmalloc")
    assert returned["build"] > 28, returned  # the 32 MiB left resident memory as they were freed
    if who == "jemalloc":
        assert returned["hold"] < 24, returned  # half kept for reuse while training (measured 16 MiB returned)
