"""How a replica knows when it has seen all of its share of an optimizer step.

A block held by one peer sees every micro-batch, so it steps after every K gradients. A replica
sees only the micro-batches routed to it, and the routing is decided hop by hop. So every sender
whose next block is replicated tells each holder, after its last micro-batch of a step, how many of
that step's micro-batches it sent there (a ``StepEnd`` marker, on the same ordered stream). A replica
whose upstream is itself replicated adds up the markers of all its upstream peers. A replica steps
after exactly its share of gradients, a share of zero included, so the weight versions of all
holders of a block advance together with the data source's steps.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class SenderSplit:
    """The sender's side: per step, how many micro-batches went to each downstream replica.

    ``expected`` of a step is K for a sender that sees every micro-batch, or the sender's own share
    when it is a replica (known once its upstream markers are in).
    """

    def __init__(self, downstreams: Iterable[str], fixed: int | None = None) -> None:
        self.downstreams = list(downstreams)
        self.fixed = fixed
        self._expected: dict[int, int] = {}
        self._forwarded: dict[int, Counter] = {}

    def expect(self, step: int, count: int) -> None:
        self._expected[step] = count

    def forwarded(self, step: int, peer: str) -> None:
        self._forwarded.setdefault(step, Counter())[peer] += 1

    def remove(self, peer: str) -> None:
        if peer in self.downstreams:
            self.downstreams.remove(peer)

    def complete(self) -> list[tuple[int, dict[str, int]]]:
        """Steps whose every micro-batch has been forwarded: (step, count per downstream), in step order."""
        done = []
        steps = sorted(set(self._expected) | set(self._forwarded))
        for step in steps:
            expected = self.fixed if self.fixed is not None else self._expected.get(step)
            counts = self._forwarded.get(step, Counter())
            if expected is None or sum(counts.values()) < expected:
                continue
            done.append((step, {p: counts.get(p, 0) for p in self.downstreams}))
            self._expected.pop(step, None)
            self._forwarded.pop(step, None)
        return done


class UpstreamShares:
    """The replica's side: adds up the markers of every upstream peer into this replica's share of a step."""

    def __init__(self, upstreams: Iterable[str]) -> None:
        self.upstreams = set(upstreams)
        self._markers: dict[int, dict[str, int]] = {}
        self._received: dict[int, Counter] = {}
        self._done_through = -1
        self._lock = threading.Lock()  # received() runs on the compute thread, with the forward it counts

    def received(self, step: int, upstream: str) -> None:
        """An activation of ``step`` from ``upstream`` was computed here (what a vanished sender is known to
        have sent). Counted with the forward itself, so a cancelled or failed forward is never counted."""
        with self._lock:
            self._received.setdefault(step, Counter())[upstream] += 1

    def marker(self, step: int, upstream: str, count: int) -> list[tuple[int, int]]:
        with self._lock:
            if upstream not in self.upstreams:
                raise ValueError(f"step marker from {upstream!r}, which is not an upstream peer of this stage")
            if step <= self._done_through:
                raise ValueError(f"second step marker for step {step} from {upstream!r}")
            self._markers.setdefault(step, {})[upstream] = count
            return self._ready()

    def remove(self, upstream: str) -> list[tuple[int, int]]:
        """An upstream peer vanished: what it sent is all it will send; steps it left open complete."""
        with self._lock:
            if upstream not in self.upstreams:
                return []
            self.upstreams.discard(upstream)
            for step in set(self._received) | set(self._markers):
                if step > self._done_through:
                    sent = self._received.get(step, Counter()).get(upstream, 0)
                    self._markers.setdefault(step, {}).setdefault(upstream, sent)
            return self._ready()

    def _ready(self) -> list[tuple[int, int]]:
        done = []
        for step in sorted(self._markers):
            got = self._markers[step]
            if not self.upstreams <= set(got):
                break  # steps complete in order: markers travel in order on each stream
            done.append((step, sum(got.values())))
            self._done_through = step
            del self._markers[step]
            self._received.pop(step, None)
        return done
