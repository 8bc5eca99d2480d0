"""A DHT node behind NAT that restarts on its fixed port reaches its bootstrap node every time.

A peer behind NAT restarts its DHT node as a client once the dial-back shows it unreachable; a peer
restarted by its supervisor starts a new node on the same ``--dht-port``. Meanwhile the coordinator's
node keeps dialling the old one at that address (its SYNs dropped by the NAT). Run with
`pytest -m lab tests/lab/test_nat_dht.py` as root with `nft` installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # benchmarks/ is not an installed package

from benchmarks.lab import Lab, parse_link, unavailable_reason  # noqa: E402
from tests.lab.test_nat import RULES  # noqa: E402

pytestmark = pytest.mark.lab

PROC = Path(__file__).with_name("dht_restart_proc.py")
PORT = 31401
CYCLES = 3


def _skip_reason() -> str | None:
    if shutil.which("nft") is None:
        return "nft (Debian's nftables) is not installed"
    return unavailable_reason()


def _wait_for_maddr(log: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines(keepends=True):
            if line.startswith("MADDR ") and line.endswith("\n"):
                return line.split()[1]
        assert proc.poll() is None, f"bootstrap node exited:\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"bootstrap node printed no multiaddr within {timeout:.0f} s:\n{log.read_text()}")


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_a_node_behind_nat_restarted_on_its_port_reaches_the_bootstrap_node(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(_ROOT), "PYTHONUNBUFFERED": "1"}
    with Lab([parse_link("lan")], coordinator=True) as lab:
        peer, co = lab.host("p0"), lab.coordinator
        rules = tmp_path / "home_router.nft"
        rules.write_text(RULES)
        peer.run(["nft", "-f", str(rules)], check=True, timeout=30)
        co_log = tmp_path / "bootstrap.log"
        with co_log.open("w") as out:
            boot = co.popen([sys.executable, str(PROC), "bootstrap", co.address, str(PORT)], cwd=_ROOT,
                            env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        maddr = _wait_for_maddr(co_log, boot)
        args = [sys.executable, str(PROC), "restart", peer.address, str(PORT), maddr, str(CYCLES)]
        done = peer.run(args, cwd=_ROOT, env=env, timeout=240, text=True)
        dropped = peer.run(["nft", "list", "chain", "inet", "home_router", "input"], timeout=30, text=True).stdout
    starts = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(starts) == 2 * CYCLES, f"{done.stdout}\n{done.stderr[-3000:]}"
    failed = [s for s in starts if s["error"]]
    assert not failed, f"{len(failed)} of {len(starts)} starts could not reach the bootstrap node: {failed}"
    assert "counter packets 0 " not in dropped, f"the bootstrap node never dialled in, nothing was tested:\n{dropped}"
