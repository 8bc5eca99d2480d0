"""Peers behind home NAT (inbound connections dropped by nftables) still serve blocks and train.

Run with `pytest -m lab tests/lab/test_nat.py` as root with `nft` installed; it skips otherwise.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # benchmarks/ is not an installed package

from benchmarks.lab import Lab, parse_link, unavailable_reason  # noqa: E402
from benchmarks.lab_swarm import DHT_PORT, STAGE_PORT, run_swarm  # noqa: E402

pytestmark = pytest.mark.lab

BEHIND_NAT = ("p1", "p2")  # neighbours in peer order: the coordinator must pull them apart
RULES = """
table inet home_router {
  chain input {
    type filter hook input priority 0; policy accept;
    iif "lo" accept
    ct state established,related accept
    tcp flags syn counter drop
  }
}
"""


def _skip_reason() -> str | None:
    if shutil.which("nft") is None:
        return "nft (Debian's nftables) is not installed"
    return unavailable_reason()


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_two_peers_behind_nat_train_and_never_accept_a_connection(tmp_path: Path) -> None:
    with Lab([parse_link("lan")] * 4, coordinator=True) as lab:
        rules = tmp_path / "home_router.nft"
        rules.write_text(RULES)
        for name in BEHIND_NAT:
            lab.host(name).run(["nft", "-f", str(rules)], check=True, timeout=30)
        result = run_swarm(
            lab,
            "nat",
            tmp_path,
            [
                "--model",
                "gpt-small",
                "--steps",
                "12",
                "--micro-batches",
                "2",
                "--micro-batch-size",
                "2",
                "--eval-every",
                "0",
                "--eval-batches",
                "2",
                "--checkpoint-every",
                "0",
            ],
            timeout=600,
        )
        counters = {
            name: lab.host(name)
            .run(["nft", "list", "chain", "inet", "home_router", "input"], timeout=30, text=True)
            .stdout
            for name in BEHIND_NAT
        }
    out = result.output
    assert "behind NAT (they dial their neighbours): " in out, out
    plan_line = next(line for line in out.splitlines() if line.startswith("plan: "))
    order = [part.split("=")[0] for part in plan_line[len("plan: ") :].split(", ")]
    assert sorted(order) == ["p0", "p1", "p2", "p3"]
    for a, b in zip(order, order[1:], strict=False):
        assert not (a in BEHIND_NAT and b in BEHIND_NAT), f"two peers behind NAT are neighbours: {order}"
    losses = [m["loss"] for m in result.steps]
    assert len(losses) == 12 and losses[-1] < losses[0]
    for name, listing in counters.items():
        # the coordinator's dial-back (and any DHT dial) hit the drop rule: nobody connected in
        assert "counter packets 0 " not in listing, f"{name}: no inbound attempt was ever dropped?\n{listing}"
    for name in BEHIND_NAT:
        log = (tmp_path / f"nat-{name}.log").read_text()
        assert "not reachable from outside" in log
    assert STAGE_PORT and DHT_PORT
