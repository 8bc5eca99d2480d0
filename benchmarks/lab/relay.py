"""User-space delaying TCP relay: the lab's stand-in for `netem delay`, which this kernel lacks.

The lab starts one relay in front of a server's port, inside the server's namespace. Every byte read
from either side is held for the one-way delay of the link pair and then written on, so request/
response traffic sees the configured RTT while bandwidth is still capped by `tc` on the veths.

Guarantees: bytes keep their order (one FIFO per direction, one writer), half-close is forwarded
(EOF on one side becomes `shutdown(SHUT_WR)` on the other after the same delay, the other direction
keeps flowing), memory is bounded (a direction stops reading when `buffer_bytes` are in flight,
which pushes back on the sender through TCP), and nothing polls: each direction sleeps until the
next chunk is due. Throughput through a relay is capped at `buffer_bytes / one-way delay` (16 MiB
at 50 ms one way, a 100 ms RTT, is ~2.7 Gbit/s), far above any home link.

What it does not emulate: the TCP handshake is not delayed (a connect completes at LAN speed), and
TCP congestion control sees a short RTT (the delay is outside the kernel), so slow start over a
long fat pipe is not reproduced. Self-contained (stdlib, optional uvloop) so it can run as
`python -m benchmarks.lab.relay` inside any namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CHUNK = 256 * 1024
DEFAULT_BUFFER = 16 * 1024 * 1024
_STREAM_LIMIT = 1024 * 1024  # StreamReader pauses the socket at 2x this: the kernel-side part of the bound


@dataclass(frozen=True)
class RelayConfig:
    """Where to forward and how long to hold bytes, per direction.

    `delay_ms` is the one-way delay for clients not listed in `source_delay_ms` (keyed by client IP),
    so one relay can give each remote peer the delay of its own link pair.
    """

    target_host: str
    target_port: int
    delay_ms: float = 0.0
    source_delay_ms: Mapping[str, float] = field(default_factory=dict)
    buffer_bytes: int = DEFAULT_BUFFER

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or any(d < 0 for d in self.source_delay_ms.values()):
            raise ValueError("delays must be >= 0")
        if self.buffer_bytes < CHUNK:
            raise ValueError(f"buffer_bytes must be at least {CHUNK}")

    def delay_s(self, client_ip: str) -> float:
        """One-way delay in seconds for a client address."""
        return self.source_delay_ms.get(client_ip, self.delay_ms) / 1000.0


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, limit: int) -> None:
    """Copy `reader` to `writer`, delivering each chunk `delay_s` after it was read; forward EOF.

    Reading and writing are two tasks joined by a FIFO: the reader stamps each chunk with its due
    time and stops while `limit` bytes are queued; the writer sleeps until the oldest chunk is due,
    writes every chunk due by then, and waits for the socket to drain (backpressure downstream).
    """
    loop = asyncio.get_running_loop()
    queue: deque[tuple[float, bytes]] = deque()
    queued = 0
    has_data = asyncio.Event()
    has_room = asyncio.Event()
    has_room.set()

    failure: list[BaseException] = []

    async def fill() -> None:
        nonlocal queued
        while True:
            await has_room.wait()
            try:
                data = await reader.read(CHUNK)
            except OSError as exc:  # wake the writer loop so the reset reaches the other side now
                failure.append(exc)
                has_data.set()
                raise
            queue.append((loop.time() + delay_s, data))  # b"" marks EOF and travels with the same delay
            queued += len(data)
            if queued >= limit:
                has_room.clear()
            has_data.set()
            if not data:
                return

    filler = asyncio.create_task(fill())
    try:
        while True:
            await has_data.wait()
            if failure:
                raise failure[0]
            wait = queue[0][0] - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            now, eof = loop.time(), False
            while queue and queue[0][0] <= now:
                _, data = queue.popleft()
                if not data:
                    eof = True
                    break
                writer.write(data)
                queued -= len(data)
            if not queue:
                has_data.clear()
            await writer.drain()
            if queued < limit:
                has_room.set()
            if eof:
                if writer.can_write_eof():
                    writer.write_eof()
                await filler  # already finished: surfaces its exception, if any
                return
    finally:
        filler.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await filler


def _abort(*writers: asyncio.StreamWriter) -> None:
    for w in writers:
        w.transport.abort()


async def _handle(cfg: RelayConfig, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
    client_ip = c_writer.get_extra_info("peername")[0]
    delay = cfg.delay_s(client_ip)
    try:
        s_reader, s_writer = await asyncio.open_connection(cfg.target_host, cfg.target_port, limit=_STREAM_LIMIT)
    except OSError as exc:
        print(f"relay: cannot reach {cfg.target_host}:{cfg.target_port}: {exc}", file=sys.stderr, flush=True)
        _abort(c_writer)
        return
    for w in (c_writer, s_writer):
        sock = w.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the relay must not add Nagle delays
    clean = False
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(pipe(c_reader, s_writer, delay, cfg.buffer_bytes))
            tg.create_task(pipe(s_reader, c_writer, delay, cfg.buffer_bytes))
        clean = True
    except* OSError:
        pass
    finally:
        if not clean:  # a reset or shutdown on one side becomes an abort (RST) on the other
            _abort(c_writer, s_writer)  # also: a graceful close would wait forever on a stalled peer
        for w in (c_writer, s_writer):
            w.close()
            try:
                await asyncio.wait_for(w.wait_closed(), timeout=5.0)
            except TimeoutError:
                _abort(w)
            except OSError:
                pass


async def start_relay(listen_host: str, listen_port: int, cfg: RelayConfig) -> asyncio.Server:
    """Start a relay in the running event loop; the bound port is `server.sockets[0].getsockname()[1]`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _handle(cfg, reader, writer)

    return await asyncio.start_server(handle, listen_host, listen_port, limit=_STREAM_LIMIT, reuse_address=True)


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _source_delay(text: str) -> tuple[str, float]:
    ip, _, ms = text.partition("=")
    if not ms:
        raise argparse.ArgumentTypeError(f"expected IP=MS, got {text!r}")
    return ip, float(ms)


async def _serve(args: argparse.Namespace) -> None:
    target_host, target_port = args.target
    cfg = RelayConfig(target_host, target_port, args.delay_ms, dict(args.source_delay), args.buffer)
    server = await start_relay(*args.listen, cfg)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)  # the lab waits for this line
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: `python -m benchmarks.lab.relay --listen IP:PORT --target IP:PORT --delay-ms 20`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_hostport, required=True, help="HOST:PORT to accept on (port 0: any)")
    parser.add_argument("--target", type=_hostport, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    parser.add_argument("--source-delay", type=_source_delay, action="append", default=[], metavar="IP=MS",
                        help="one-way delay for a specific client address (repeatable)")  # fmt: skip
    parser.add_argument("--buffer", type=int, default=DEFAULT_BUFFER, help="max bytes in flight per direction")
    parser.add_argument("--no-uvloop", action="store_true", help="use the stdlib event loop")
    args = parser.parse_args(argv)
    runner = asyncio.run
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            runner = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(_serve(args))


if __name__ == "__main__":
    main()
