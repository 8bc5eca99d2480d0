"""The live progress line: step, loss, tokens/s, wire MB/s; plain lines when not on a terminal."""

from __future__ import annotations

import math
import sys
import time
from collections import deque

from rich.console import Console


class Progress:
    WIRE_WINDOW_S = 5.0

    def __init__(self, total_steps: int, *, console: Console | None = None, every_s: float = 5.0) -> None:
        self.total = total_steps
        self.console = console or Console(stderr=False, highlight=False)
        self.live = self.console.is_terminal and sys.stdout.isatty()
        self.every_s = every_s
        self.step = -1
        self.loss = float("nan")
        self.val: float | None = None
        self.tokens_per_s = 0.0
        self.wire_mb_s = 0.0
        self._t0 = time.monotonic()
        self._tokens = 0
        self._wire: deque[tuple[float, int]] = deque()
        self._printed = 0.0
        self._status = None

    def start(self) -> None:
        self._t0 = time.monotonic()
        if self.live:
            self._status = self.console.status(self._line())
            self._status.start()

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def message(self, text: str) -> None:
        self.console.print(text, soft_wrap=True)

    def on_step(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        self.step, self.loss = step, loss
        self._tokens += tokens
        self.tokens_per_s = self._tokens / max(time.monotonic() - self._t0, 1e-9)
        self._refresh(force=step == 0 or step + 1 == self.total)

    def on_eval(self, step: int, loss: float) -> None:
        self.val = loss
        if self._status is None:
            self.console.print(f"step {step + 1}: validation loss {loss:.3f}")

    def on_wire(self, total_bytes: int) -> None:
        """Bytes sent by all peers so far; the rate is taken over a window of a few report periods."""
        now = time.monotonic()
        self._wire.append((now, total_bytes))
        while len(self._wire) > 2 and now - self._wire[0][0] > self.WIRE_WINDOW_S:
            self._wire.popleft()
        (t0, b0), (t1, b1) = self._wire[0], self._wire[-1]
        if t1 - t0 >= 1.0:
            self.wire_mb_s = max(b1 - b0, 0) / (t1 - t0) / 1e6

    def _line(self) -> str:
        val = f" | val {self.val:.3f}" if self.val is not None else ""
        return (
            f"step {self.step + 1}/{self.total} | loss {'-' if math.isnan(self.loss) else f'{self.loss:.3f}'}{val} | "
            f"{self.tokens_per_s:,.0f} tok/s | wire {self.wire_mb_s:.1f} MB/s"
        )

    def _refresh(self, force: bool = False) -> None:
        if self._status is not None:
            self._status.update(self._line())
            return
        now = time.monotonic()
        if force or now - self._printed >= self.every_s:
            self._printed = now
            self.console.print(self._line(), soft_wrap=True)
