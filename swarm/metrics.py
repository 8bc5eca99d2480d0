"""Prometheus metrics for the peer and coordinator daemons, each on its own registry and HTTP port.

Why a module of its own: both daemons already count everything worth watching (a peer's ``StageStats``,
the coordinator's steps and losses); this module only turns those snapshots into Prometheus families
when something scrapes them. Nothing here touches the training path: updates store a snapshot under a
lock, and the HTTP thread of ``prometheus_client`` reads it at scrape time.

Why not the global ``prometheus_client.REGISTRY``: ``ravn local`` and the tests run several daemons in
one process, and two of them must not clash on metric names. Every ``MetricsServer`` owns a
``CollectorRegistry``.

Why custom collectors instead of ``Counter``/``Gauge`` objects: the daemons report cumulative totals
(bytes sent, compute seconds, applied gradients by staleness), and a ``Counter`` can only be
incremented. A collector that emits the latest snapshot keeps the numbers exactly equal to what the
run's ``metrics.jsonl`` and ``ravn status`` show.

Metric names (all prefixed ``ravn_``; ``peer`` label on every peer metric):

peer: ``ravn_peer_stage``, ``ravn_peer_layer_start``, ``ravn_peer_layer_end``,
``ravn_peer_forward_micro_batches_total``, ``ravn_peer_backward_micro_batches_total``,
``ravn_peer_sent_bytes_total``, ``ravn_peer_received_bytes_total``, ``ravn_peer_compute_seconds_total``,
``ravn_peer_idle_seconds_total``, ``ravn_peer_tokens_per_second``, ``ravn_peer_upload_mbit_per_second``,
``ravn_peer_download_mbit_per_second``, ``ravn_peer_bubble_fraction``, ``ravn_peer_gradient_staleness``
(histogram, buckets in weight versions), ``ravn_peer_dropped_gradients_total``,
``ravn_peer_refused_packets_total``, ``ravn_peer_weight_version``, ``ravn_peer_in_flight_peak``,
``ravn_peer_kept_weights_peak_bytes``, ``ravn_peer_held_gradients_peak_bytes``.

coordinator: ``ravn_run_info`` (labels swarm, run), ``ravn_run_step``, ``ravn_run_total_steps``,
``ravn_run_train_loss``, ``ravn_run_val_loss``, ``ravn_run_tokens_total``, ``ravn_run_tokens_per_second``,
``ravn_run_peers`` (label state), ``ravn_run_uncovered_blocks``, ``ravn_run_wire_sent_bytes``,
``ravn_run_wire_bytes_per_token``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from swarm.pb import control_pb2 as cpb

Clock = Callable[[], float]
MAX_STALENESS_BUCKETS = 256  # a histogram longer than this is cut: the tail goes to +Inf


# ---- rates between two StageStats snapshots (shared with coordinator.status_view) ------------------
@dataclass(frozen=True)
class StageRates:
    """What changed between two snapshots of one stage, per second (``None`` without a usable window)."""

    tokens_per_s: float | None
    up_mbit_s: float | None
    down_mbit_s: float | None
    bubble_fraction: float | None
    dropped: int  # gradients dropped as too stale during the window
    refused: int  # packets refused during the window


def stage_rates(
    then: cpb.StageStats | None, now: cpb.StageStats, seconds: float, tokens_per_micro_batch: int = 0
) -> StageRates:
    """Rates of one stage between snapshots ``then`` and ``now`` taken ``seconds`` apart.

    Counters that went backwards (the peer restarted its block) count as a fresh start from zero, so a
    restart never shows as a negative rate. Without ``then`` or a positive window, rates are ``None``
    and the bubble fraction is the whole-lifetime one.
    """

    def delta(a: float, b: float) -> float:
        return b - a if b >= a else b

    if then is None or seconds <= 0:
        bubble = now.idle_seconds / now.wall_seconds if now.wall_seconds > 0 else None
        return StageRates(None, None, None, _clamp01(bubble), 0, 0)
    wall = delta(then.wall_seconds, now.wall_seconds)
    idle = delta(then.idle_seconds, now.idle_seconds)
    forward = delta(then.forward_micro_batches, now.forward_micro_batches)
    return StageRates(
        tokens_per_s=forward * tokens_per_micro_batch / seconds if tokens_per_micro_batch else None,
        up_mbit_s=delta(then.bytes_sent, now.bytes_sent) * 8 / 1e6 / seconds,
        down_mbit_s=delta(then.bytes_received, now.bytes_received) * 8 / 1e6 / seconds,
        bubble_fraction=_clamp01(idle / wall) if wall > 0 else None,
        dropped=int(delta(then.dropped, now.dropped)),
        refused=int(delta(then.refused, now.refused)),
    )


def _clamp01(x: float | None) -> float | None:
    return None if x is None else min(max(x, 0.0), 1.0)


def _num(x: float | None) -> float:
    """Prometheus has no 'missing'; NaN is its conventional stand-in for a value not known yet."""
    return math.nan if x is None else float(x)


# ---- the peer ------------------------------------------------------------------------------------
class PeerMetrics(Collector):
    """Latest ``StageStats`` of one peer, plus rates over a sliding window of updates.

    Call :meth:`set_assignment` when the coordinator assigns a block and :meth:`update` with
    ``PeerDaemon.stats()`` every report; both are cheap (a lock and a copy).
    """

    def __init__(self, peer_id: str, *, window_s: float = 10.0, clock: Clock = time.monotonic) -> None:
        self.peer_id = peer_id
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stats = cpb.StageStats()
        self._history: deque[tuple[float, cpb.StageStats]] = deque()
        self._stage: int | None = None
        self._layers: tuple[int, int] | None = None
        self._tokens_per_mb = 0

    def set_assignment(self, stage: int, layer_start: int, layer_end: int, tokens_per_micro_batch: int) -> None:
        """The block this peer holds; ``tokens_per_micro_batch`` (batch size x context) turns micro-batches
        into tokens."""
        with self._lock:
            self._stage, self._layers, self._tokens_per_mb = stage, (layer_start, layer_end), tokens_per_micro_batch

    def update(self, stats: cpb.StageStats, *, now: float | None = None) -> None:
        """Record a snapshot; rates are taken between the oldest snapshot in the window and this one."""
        t = self._clock() if now is None else now
        snapshot = cpb.StageStats()
        snapshot.CopyFrom(stats)
        with self._lock:
            self._stats = snapshot
            self._history.append((t, snapshot))
            while len(self._history) > 2 and t - self._history[1][0] >= self.window_s:
                self._history.popleft()

    def rates(self) -> StageRates:
        """Rates over the current window (what the gauges show)."""
        with self._lock:
            return self._rates_locked()

    def _rates_locked(self) -> StageRates:
        if len(self._history) < 2:
            return stage_rates(None, self._stats, 0.0, self._tokens_per_mb)
        (t0, s0), (t1, s1) = self._history[0], self._history[-1]
        return stage_rates(s0, s1, t1 - t0, self._tokens_per_mb)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            s, rates = self._stats, self._rates_locked()
            stage, layers = self._stage, self._layers
        labels = ["peer"]
        value = [self.peer_id]

        def gauge(name: str, doc: str, v: float | None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, _num(v))
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, float(v))
            return c

        yield gauge("ravn_peer_stage", "Pipeline stage this peer holds (NaN before its assignment).", stage)
        yield gauge("ravn_peer_layer_start", "First layer of this peer's block.", layers[0] if layers else None)
        yield gauge(
            "ravn_peer_layer_end", "Layer after the last one of this peer's block.", layers[1] if layers else None
        )
        yield counter("ravn_peer_forward_micro_batches", "Training micro-batches run forward.", s.forward_micro_batches)
        yield counter("ravn_peer_backward_micro_batches", "Micro-batches run backward.", s.backward_micro_batches)
        yield counter("ravn_peer_sent_bytes", "Bytes sent to the neighbours.", s.bytes_sent)
        yield counter("ravn_peer_received_bytes", "Bytes received from the neighbours.", s.bytes_received)
        yield counter("ravn_peer_compute_seconds", "Seconds the compute thread spent computing.", s.compute_seconds)
        yield counter("ravn_peer_idle_seconds", "Seconds the compute thread waited for work.", s.idle_seconds)
        yield gauge(
            "ravn_peer_tokens_per_second", "Training tokens through this stage per second (window).", rates.tokens_per_s
        )
        yield gauge("ravn_peer_upload_mbit_per_second", "Upload to the neighbours, Mbit/s (window).", rates.up_mbit_s)
        yield gauge(
            "ravn_peer_download_mbit_per_second", "Download from the neighbours, Mbit/s (window).", rates.down_mbit_s
        )
        yield gauge(
            "ravn_peer_bubble_fraction",
            "Share of wall time the compute thread was idle (window).",
            rates.bubble_fraction,
        )
        yield _staleness_histogram(labels, value, list(s.staleness_counts))
        yield counter("ravn_peer_dropped_gradients", "Gradients dropped as too stale.", s.dropped)
        yield counter("ravn_peer_refused_packets", "Packets from neighbours refused as bad input.", s.refused)
        yield counter(
            "ravn_peer_rejected_tensors", "Neighbours' tensors rejected as implausible (dropped).", s.rejected
        )
        by_sender = CounterMetricFamily(
            "ravn_peer_rejected_tensors_by_sender",
            "Implausible tensors rejected, per sending neighbour.",
            labels=["peer", "sender"],
        )
        for sender, n in sorted(s.rejected_by_sender.items()):
            by_sender.add_metric([self.peer_id, sender], float(n))
        yield by_sender
        yield gauge("ravn_peer_weight_version", "Optimizer steps this stage has applied.", s.weight_version)
        yield gauge("ravn_peer_in_flight_peak", "Most micro-batches held at once by this stage.", s.in_flight_peak)
        yield gauge(
            "ravn_peer_kept_weights_peak_bytes",
            "Peak memory of trainable weights kept for stale backwards.",
            s.kept_weights_bytes_peak,
        )
        yield gauge(
            "ravn_peer_held_gradients_peak_bytes",
            "Peak memory of gradients held till their own step's update (they overtook an earlier step's).",
            s.held_gradient_bytes_peak,
        )


def _staleness_histogram(labels: list[str], value: list[str], counts: list[int]) -> HistogramMetricFamily:
    """Applied gradients by staleness (0, 1, 2 ... weight versions late) as a cumulative histogram."""
    kept, tail = counts[:MAX_STALENESS_BUCKETS], sum(counts[MAX_STALENESS_BUCKETS:])
    buckets: list[tuple[str, float]] = []
    running = 0
    for staleness, n in enumerate(kept):
        running += n
        buckets.append((str(staleness), float(running)))
    buckets.append(("+Inf", float(running + tail)))
    total = sum(i * n for i, n in enumerate(counts))
    h = HistogramMetricFamily(
        "ravn_peer_gradient_staleness", "Applied gradients by staleness, in weight versions.", labels=labels
    )
    h.add_metric(value, buckets, float(total))
    return h


# ---- the coordinator -----------------------------------------------------------------------------
class CoordinatorMetrics(Collector):
    """The run as the coordinator sees it: step, losses, throughput, membership, wire cost.

    Call :meth:`on_step` / :meth:`on_eval` from ``SwarmRun.on_report``, :meth:`set_peers` and
    :meth:`set_uncovered_blocks` when membership changes, and :meth:`set_wire_bytes` with the sum of
    the peers' ``bytes_sent``.
    """

    def __init__(self, swarm: str, run: str, *, window_s: float = 30.0, clock: Clock = time.monotonic) -> None:
        self.swarm, self.run = swarm, run
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._step: int | None = None
        self._total_steps: int | None = None
        self._loss: float | None = None
        self._val_loss: float | None = None
        self._tokens = 0
        self._wire_bytes = 0
        self._peers: dict[str, int] = {}
        self._uncovered = 0
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens so far)

    def set_total_steps(self, steps: int) -> None:
        with self._lock:
            self._total_steps = steps

    def on_step(self, step: int, loss: float, tokens: int, *, now: float | None = None) -> None:
        """Step ``step`` (0-based) finished with ``loss`` over ``tokens`` tokens."""
        t = self._clock() if now is None else now
        with self._lock:
            self._step = step + 1
            self._loss = loss
            self._tokens += tokens
            self._window.append((t, self._tokens))
            while len(self._window) > 2 and t - self._window[1][0] >= self.window_s:
                self._window.popleft()

    def on_eval(self, step: int, loss: float) -> None:
        with self._lock:
            self._val_loss = loss

    def set_peers(self, states: Mapping[str, int]) -> None:
        """How many peers are in each state (joining, online, leaving, ...); replaces the previous counts."""
        with self._lock:
            self._peers = {str(k): int(v) for k, v in states.items()}

    def set_uncovered_blocks(self, n: int) -> None:
        with self._lock:
            self._uncovered = n

    def set_wire_bytes(self, total_bytes: int) -> None:
        """Bytes sent by all peers so far (the sum of their ``StageStats.bytes_sent``)."""
        with self._lock:
            self._wire_bytes = total_bytes

    def tokens_per_s(self) -> float | None:
        with self._lock:
            return self._tokens_per_s_locked()

    def _tokens_per_s_locked(self) -> float | None:
        if len(self._window) < 2:
            return None
        (t0, n0), (t1, n1) = self._window[0], self._window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            step, total, loss, val = self._step, self._total_steps, self._loss, self._val_loss
            tokens, wire, peers, uncovered = self._tokens, self._wire_bytes, dict(self._peers), self._uncovered
            rate = self._tokens_per_s_locked()
        info = InfoMetricFamily("ravn_run", "The swarm and run this coordinator drives.", labels=["swarm", "run"])
        info.add_metric([self.swarm, self.run], {})
        yield info

        def gauge(name: str, doc: str, v: float | None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=_num(v))

        yield gauge("ravn_run_step", "Optimizer steps completed.", step or 0)
        yield gauge("ravn_run_total_steps", "Optimizer steps this run was asked for.", total)
        yield gauge("ravn_run_train_loss", "Training loss of the last step (nats/token).", loss)
        yield gauge("ravn_run_val_loss", "Last validation loss (nats/token).", val)
        yield CounterMetricFamily("ravn_run_tokens", "Training tokens processed.", value=float(tokens))
        yield gauge("ravn_run_tokens_per_second", "Training tokens per second (window).", rate)
        g = GaugeMetricFamily("ravn_run_peers", "Peers by state.", labels=["state"])
        for state, n in sorted(peers.items()):
            g.add_metric([state], float(n))
        yield g
        yield gauge("ravn_run_uncovered_blocks", "Blocks of layers no live peer holds.", uncovered)
        yield gauge("ravn_run_wire_sent_bytes", "Bytes sent between peers so far.", wire)
        yield gauge(
            "ravn_run_wire_bytes_per_token", "Bytes on the wire per training token.", wire / tokens if tokens else None
        )


# ---- the server ----------------------------------------------------------------------------------
class MetricsServer:
    """One ``/metrics`` endpoint with its own registry; start it once per daemon.

    ``host`` defaults to loopback: metrics name peers and addresses, so exposing them is a choice
    (``--metrics-host 0.0.0.0``), not an accident.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def peer(self, peer_id: str, **kwargs) -> PeerMetrics:
        """Register and return the metrics of one peer."""
        metrics = PeerMetrics(peer_id, **kwargs)
        self.registry.register(metrics)
        return metrics

    def coordinator(self, swarm: str, run: str, **kwargs) -> CoordinatorMetrics:
        """Register and return the metrics of a coordinator's run."""
        metrics = CoordinatorMetrics(swarm, run, **kwargs)
        self.registry.register(metrics)
        return metrics

    def start(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port (0: any free one)."""
        if self._httpd is not None:
            raise RuntimeError(f"metrics server already listening on port {self.port}")
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return self.port

    @property
    def port(self) -> int:
        return self._httpd.server_port if self._httpd is not None else 0

    def scrape(self) -> str:
        """The exposition text a scrape would get, without HTTP (logs, tests, debugging)."""
        return generate_latest(self.registry).decode()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._httpd = self._thread = None

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
