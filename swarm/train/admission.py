"""Admission under bounded staleness: when may the data source start the next micro-batch?

Every stage steps its optimizer once a step's ``K`` micro-batches of gradient are through it, so a stage's
weight version is the number of whole steps it has processed, whatever order their gradients came back in
(replicas of a later stage return them out of order). The first stage has the longest round trip, so its
staleness bounds every other stage's: a micro-batch of step ``t`` admitted while the first stage has
processed ``d`` whole steps meets version ``t`` at its backward at most, having seen ``d`` at its forward.
Admitting only while that gap is at most ``S`` bounds staleness by S everywhere; ``S = 0``
is exactly the synchronous GPipe schedule (a step's K micro-batches, then the update, then the next).
Stages still check on their own and drop any gradient that would break the bound (a slow or
recovering peer), so the bound holds even when this prediction is wrong.

The first steps run synchronously (``sync_admissions``: the learning-rate warm-up, and ``--sync-steps``,
60 by default, beyond it): while the weights move fastest relative to their size, a late gradient is
furthest from the one it stands for (PipeMare's observation, there answered with a smaller step for the
early, stale stages). Starting async at step 20, where the warm-up ends, some runs fell ~8% behind sync
within a few steps and never caught up; starting at 60 they did not (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Admission:
    """Pure bookkeeping of the data source: admitted and processed counts, no clocks, no I/O."""

    micro_batches: int  # K: gradients per optimizer step
    max_staleness: int  # S
    max_in_flight: int  # memory bound on micro-batches out in the pipeline
    sync_admissions: int = 0  # the first this many micro-batches are admitted as if S were 0
    window: int | None = None  # micro-batches that fill the pipeline (PipeWindow), for the 2+ late; None: S
    admitted: int = 0
    processed: int = 0  # gradients back at the first stage (applied or dropped)
    steps_done: int = 0  # leading steps whose every gradient is back: the first stage's weight version
    _back: dict[int, int] = field(default_factory=dict)  # gradients back of the steps after those

    def __post_init__(self) -> None:
        if self.micro_batches <= 0 or self.max_staleness < 0 or self.max_in_flight <= 0:
            raise ValueError(f"invalid admission parameters: {self}")

    @property
    def in_flight(self) -> int:
        return self.admitted - self.processed

    def staleness_if_admitted(self) -> int:
        """Versions between this stage's forward and backward of the next micro-batch."""
        return self.admitted // self.micro_batches - self.steps_done

    def can_admit(self) -> bool:
        bound = 0 if self.admitted < self.sync_admissions else self.max_staleness
        late = self.staleness_if_admitted()
        if self.in_flight >= self.max_in_flight or late > bound:
            return False
        # one version late is what keeps a pipeline busy and is what S = 1 asks for: never held back (it costs
        # +2-3% loss over 300 steps of gpt-medium, +6% over 600); later ones, which cost more, only while the
        # measured window says the pipeline needs them
        return late <= 1 or self.window is None or self.in_flight < self.window

    def admit(self) -> int:
        """Record an admission and return its sequence number."""
        if not self.can_admit():
            raise RuntimeError("admission would break the staleness or in-flight bound")
        self.admitted += 1
        return self.admitted - 1

    def complete(self, seq: int) -> int:
        """The gradient of admission number ``seq`` is back (applied or dropped); the steps that finished."""
        step = seq // self.micro_batches
        if not 0 <= seq < self.admitted or step < self.steps_done or self._back.get(step, 0) >= self.micro_batches:
            raise RuntimeError(f"gradient of admission {seq} came back twice, or was never admitted")
        self.processed += 1
        self._back[step] = self._back.get(step, 0) + 1
        finished = 0
        while self._back.get(self.steps_done) == self.micro_batches:
            del self._back[self.steps_done]
            self.steps_done += 1
            finished += 1
        return finished


@dataclass
class PipeWindow:
    """How many micro-batches in flight keep the pipeline's slowest part busy, measured as it runs.

    The staleness bound S says how late a gradient may come back, not how late it should: every micro-batch
    beyond what fills the pipeline waits in a queue, and comes back later (up to S versions) with nothing
    gained in throughput. So the window is TCP BBR's rule, the delivery rate times the round trip with
    nothing queued (the bandwidth-delay product), with headroom (``gain``) that lets it grow while the rate
    grows with it. Its floor is one step's micro-batches, what the sync schedule has in flight.

    ``Admission`` asks it only for micro-batches that would come back two or more versions late. On shared
    CPU cores a full pipeline slows every stage, so the round trip with nothing queued understates what
    fills it, and one version late costs far less than two, so the window never holds back what S = 1 admits."""

    floor: int
    gain: float = 1.25
    samples: int = 32  # the latest completions the delivery rate is measured over
    _done: deque[float] = field(default_factory=deque)
    shortest: float = math.inf  # the shortest round trip seen: a micro-batch that met no queue

    def completed(self, now: float, round_trip: float) -> None:
        """A gradient came back at ``now``, ``round_trip`` seconds after its micro-batch was admitted."""
        self._done.append(now)
        self.shortest = min(self.shortest, round_trip)
        if len(self._done) > self.samples:
            self._done.popleft()

    def size(self) -> int | None:
        """Micro-batches to keep in flight; None until enough gradients came back to measure."""
        if len(self._done) < self.samples or self._done[-1] <= self._done[0]:
            return None
        rate = (len(self._done) - 1) / (self._done[-1] - self._done[0])
        return max(self.floor, math.ceil(self.gain * rate * self.shortest))
