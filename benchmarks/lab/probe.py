"""Measurement helpers that run inside lab namespaces: bulk sink/sender and TCP ping/echo.

The lab machine has no iperf; these are small blocking-socket tools that print one JSON line with
their result, so `selftest.py` and the tests can drive them with `ip netns exec`. Servers print
`READY <port>` first so callers wait on readiness instead of sleeping.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from collections.abc import Sequence

_BUF = 1024 * 1024


def _listen(host: str, port: int) -> socket.socket:
    srv = socket.create_server((host, port), reuse_port=False)
    print(f"READY {srv.getsockname()[1]}", flush=True)
    return srv


def sink(host: str, port: int) -> dict:
    """Accept one connection, count bytes to EOF; goodput is measured from first to last byte."""
    with _listen(host, port) as srv:
        conn, _ = srv.accept()
    buf = bytearray(_BUF)
    total, first, last = 0, None, None
    with conn:
        while n := conn.recv_into(buf):
            last = time.monotonic()
            first = first or last
            total += n
    seconds = (last - first) if first is not None and last is not None else 0.0
    return {"bytes": total, "seconds": seconds, "mbit_s": total * 8 / seconds / 1e6 if seconds else 0.0}


def send(host: str, port: int, seconds: float) -> dict:
    """Send as fast as the link allows for `seconds`, then half-close and wait for the sink to close."""
    payload = memoryview(bytes(256 * 1024))
    total = 0
    with socket.create_connection((host, port), timeout=30) as conn:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            conn.sendall(payload)
            total += len(payload)
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(_BUF):
            pass
    return {"bytes": total}


def _echo_conn(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(65536):
            conn.sendall(data)


def echo(host: str, port: int) -> None:
    """Echo every connection until EOF, forever (the lab stops it)."""
    with _listen(host, port) as srv:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_echo_conn, args=(conn,), daemon=True).start()


def ping(host: str, port: int, count: int, size: int) -> dict:
    """Round trips of `size`-byte messages over one connection; the first (warm-up) is not counted."""
    msg = bytes(size)
    rtts = []
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count + 1):
            start = time.monotonic()
            conn.sendall(msg)
            got = 0
            while got < size:
                chunk = conn.recv(size - got)
                if not chunk:
                    raise ConnectionError("echo server closed the connection")
                got += len(chunk)
            rtts.append((time.monotonic() - start) * 1000)
    rtts = rtts[1:]
    return {
        "count": len(rtts),
        "min_ms": min(rtts),
        "median_ms": statistics.median(rtts),
        "p90_ms": statistics.quantiles(rtts, n=10)[-1] if len(rtts) > 1 else rtts[0],
        "max_ms": max(rtts),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: `python -m benchmarks.lab.probe {sink,send,echo,ping} HOST PORT [...]`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("sink", "send", "echo", "ping"):
        p = sub.add_parser(mode)
        p.add_argument("host")
        p.add_argument("port", type=int)
        if mode == "send":
            p.add_argument("--seconds", type=float, default=3.0)
        if mode == "ping":
            p.add_argument("--count", type=int, default=20)
            p.add_argument("--size", type=int, default=64)
    args = parser.parse_args(argv)
    if args.mode == "sink":
        result = sink(args.host, args.port)
    elif args.mode == "send":
        result = send(args.host, args.port, args.seconds)
    elif args.mode == "ping":
        result = ping(args.host, args.port, args.count, args.size)
    else:
        echo(args.host, args.port)
        return
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
