"""One logging setup for every Ravn process: rich on a terminal, plain lines in files and pipes."""

from __future__ import annotations

import logging
import sys


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
