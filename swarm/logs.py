"""One logging setup for every Ravn process: rich on a terminal, plain lines in files and pipes."""

from __future__ import annotations

import logging
import re
import sys

HANGUP_LOGGER = "ravn.hangups"
GRPC_AIO_LOGGER = "grpc._cython.cygrpc"
_METHOD = re.compile(r"servicer method \[([^\]]*)\]")


class CallerHungUp(logging.Filter):
    """grpc's asyncio server logs a traceback when a reply cannot be sent because the caller has already hung
    up, unless its own watcher noticed the hang-up first (a race it loses on a busy loop). In a swarm callers
    hang up all the time (a peer stopping mid-report, a SIGKILL, a dropped link), and the caller sees its own
    error; so that record becomes one debug line, and every other grpc record passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if type(exc).__name__ != "ExecuteBatchError":
            return True
        method = _METHOD.search(record.getMessage())
        logging.getLogger(HANGUP_LOGGER).debug(
            "the caller of %s hung up before its reply was sent", method.group(1) if method else "an RPC"
        )
        return False


def setup_logging(level: str = "INFO", *, prefix: str = "") -> None:
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler = RichHandler(show_path=False, rich_tracebacks=False)
        fmt = f"{prefix}%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("hivemind", "asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    grpc_aio = logging.getLogger(GRPC_AIO_LOGGER)
    if not any(isinstance(f, CallerHungUp) for f in grpc_aio.filters):
        grpc_aio.addFilter(CallerHungUp())
