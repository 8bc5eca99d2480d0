"""Check that a lab delivers what its profiles promise: bulk throughput per direction and relay RTT.

Run before trusting benchmark numbers from a new machine: if the shaper or the relay cannot keep up
(too few cores, missing qdisc), the table shows it instead of a benchmark silently measuring the
host. Used by `python -m benchmarks.lab --selftest` and by the lab test.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass

from benchmarks.lab import procs
from benchmarks.lab.lab import READY_TIMEOUT, Endpoint, Host, Lab

# Goodput sits a few % under the tc rate (headers are shaped too); a lab below half its cap is broken.
THROUGHPUT_TOLERANCE = (0.5, 1.1)
RTT_SLACK_MS = 5.0  # timer granularity, scheduling and the real (sub-ms) network under the relay


@dataclass(frozen=True)
class Check:
    """One row of the self-check table."""

    what: str
    path: str
    expected: float  # Mbit/s or ms; inf when uncapped
    measured: float
    unit: str
    ok: bool


def _probe(host: Host, *args: str, **kwargs) -> subprocess.Popen:
    return host.popen(procs.python_module_argv("benchmarks.lab.probe", *args), env=procs.lab_env(),
                      cwd=procs.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)  # fmt: skip


def _start_server(host: Host, mode: str) -> tuple[subprocess.Popen, int]:
    proc = _probe(host, mode, host.address, "0")
    line = procs.read_line(proc, READY_TIMEOUT)
    return proc, int(line.split()[1])


def _run_client(host: Host, *args: str, timeout: float) -> dict:
    argv = procs.python_module_argv("benchmarks.lab.probe", *args)
    result = host.run(argv, timeout=timeout, env=procs.lab_env(), cwd=procs.REPO_ROOT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"probe {args} in {host.name} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def expected_mbit(src: Host, dst: Host) -> float:
    """Bottleneck of a transfer: the sender's upload or the receiver's download cap."""
    caps = [c for c in (src.link.up_mbit, dst.link.down_mbit) if c is not None]
    return min(caps) if caps else math.inf


def measure_throughput(lab: Lab, src: Host, dst: Host, seconds: float = 3.0, via_relay: bool = False) -> float:
    """Bulk TCP goodput src -> dst in Mbit/s, measured by the receiver from first to last byte."""
    sink, port = _start_server(dst, "sink")
    target = Endpoint(dst.address, port)
    if via_relay:
        target = lab.delayed_endpoint(dst, port)
    _run_client(src, "send", target.host, str(target.port), "--seconds", str(seconds), timeout=seconds + 60)
    out, err = sink.communicate(timeout=30)
    if sink.returncode != 0:
        raise RuntimeError(f"sink in {dst.name} failed: {err.decode(errors='replace')[-2000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])["mbit_s"]


def measure_rtt(lab: Lab, client: Host, server: Host, rtt_ms: float | None = None, count: int = 20,
                via_relay: bool = True) -> dict:  # fmt: skip
    """Ping-pong RTT statistics (ms) of 64-byte messages client -> server, through a relay by default."""
    echo, port = _start_server(server, "echo")
    try:
        target = lab.delayed_endpoint(server, port, rtt_ms) if via_relay else Endpoint(server.address, port)
        timeout = 30 + count * ((rtt_ms or lab.pair_rtt_ms(client, server)) / 1000 + 0.05)
        return _run_client(client, "ping", target.host, str(target.port), "--count", str(count), timeout=timeout)
    finally:
        procs.stop(echo, grace=0.2)


def throughput_ok(expected: float, measured: float) -> bool:
    lo, hi = THROUGHPUT_TOLERANCE
    return measured > 0 if math.isinf(expected) else lo * expected <= measured <= hi * expected


def rtt_ok(expected: float, measured: float) -> bool:
    return expected * 0.98 <= measured <= expected + max(RTT_SLACK_MS, 0.1 * expected)


def run_selftest(lab: Lab, seconds: float = 3.0) -> list[Check]:
    """Measure every peer against peer 0 in both directions, then relay throughput and RTT for p1 -> p0."""
    if len(lab.peers) < 2:
        raise ValueError("the self-check needs at least 2 peers")
    checks = []
    p0 = lab.peers[0]
    for other in lab.peers[1:]:
        for src, dst in ((other, p0), (p0, other)):
            exp, got = expected_mbit(src, dst), measure_throughput(lab, src, dst, seconds)
            checks.append(Check("throughput", f"{src.name}->{dst.name}", exp, got, "Mbit/s", throughput_ok(exp, got)))
    p1 = lab.peers[1]
    exp, got = expected_mbit(p1, p0), measure_throughput(lab, p1, p0, seconds, via_relay=True)
    checks.append(Check("throughput via relay", f"{p1.name}->{p0.name}", exp, got, "Mbit/s", throughput_ok(exp, got)))
    direct = measure_rtt(lab, p1, p0, via_relay=False)["median_ms"]
    checks.append(Check("rtt direct (no relay)", f"{p1.name}->{p0.name}", 0.0, direct, "ms", direct < RTT_SLACK_MS))
    exp = lab.pair_rtt_ms(p1, p0)
    got = measure_rtt(lab, p1, p0)["median_ms"]
    checks.append(Check("rtt via relay (median)", f"{p1.name}->{p0.name}", exp, got, "ms", rtt_ok(exp, got)))
    return checks


def format_table(checks: list[Check]) -> str:
    """Fixed-width table, one row per check."""
    header = f"{'measurement':<24} {'path':<8} {'expected':>10} {'measured':>10} {'unit':<7} {'ratio':>6}  ok"
    lines = [header, "-" * len(header)]
    for c in checks:
        exp = "uncapped" if math.isinf(c.expected) else f"{c.expected:.1f}"
        ratio = f"{c.measured / c.expected:.2f}" if c.expected and not math.isinf(c.expected) else "-"
        lines.append(f"{c.what:<24} {c.path:<8} {exp:>10} {c.measured:>10.2f} {c.unit:<7} {ratio:>6}  "
                     f"{'yes' if c.ok else 'NO'}")  # fmt: skip
    return "\n".join(lines)
