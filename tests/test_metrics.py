"""swarm.metrics: real HTTP scrapes on loopback, parsed with prometheus_client's own parser."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm.metrics import MetricsServer, stage_rates
from swarm.pb import control_pb2 as cpb


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:PORT/metrics as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def stats(**kw) -> cpb.StageStats:
    return cpb.StageStats(**kw)


@pytest.fixture
def server():
    s = MetricsServer()
    yield s
    s.stop()


def test_peer_metrics_over_http(server: MetricsServer) -> None:
    clock = [100.0]
    peer = server.peer("p1", window_s=10.0, clock=lambda: clock[0])
    peer.set_assignment(stage=1, layer_start=2, layer_end=4, tokens_per_micro_batch=512)
    peer.update(
        stats(
            forward_micro_batches=10,
            bytes_sent=1_000_000,
            bytes_received=2_000_000,
            idle_seconds=1.0,
            wall_seconds=10.0,
        )
    )
    clock[0] = 102.0
    peer.update(
        stats(
            forward_micro_batches=30,
            backward_micro_batches=28,
            bytes_sent=3_500_000,
            bytes_received=4_000_000,
            compute_seconds=7.5,
            idle_seconds=1.5,
            wall_seconds=12.0,
            weight_version=7,
            dropped=2,
            refused=1,
            staleness_counts=[5, 3, 2],
            in_flight_peak=9,
            kept_weights_bytes_peak=4096,
            held_gradient_bytes_peak=1024,
        )
    )
    port = server.start(0)
    assert port > 0
    m = scrape(port)
    p = (("peer", "p1"),)
    assert m[("ravn_peer_stage", p)] == 1
    assert (m[("ravn_peer_layer_start", p)], m[("ravn_peer_layer_end", p)]) == (2, 4)
    assert m[("ravn_peer_forward_micro_batches_total", p)] == 30
    assert m[("ravn_peer_backward_micro_batches_total", p)] == 28
    assert m[("ravn_peer_sent_bytes_total", p)] == 3_500_000
    assert m[("ravn_peer_received_bytes_total", p)] == 4_000_000
    assert m[("ravn_peer_compute_seconds_total", p)] == 7.5
    assert m[("ravn_peer_tokens_per_second", p)] == pytest.approx(20 * 512 / 2)
    assert m[("ravn_peer_upload_mbit_per_second", p)] == pytest.approx(2_500_000 * 8 / 1e6 / 2)
    assert m[("ravn_peer_download_mbit_per_second", p)] == pytest.approx(2_000_000 * 8 / 1e6 / 2)
    assert m[("ravn_peer_bubble_fraction", p)] == pytest.approx(0.5 / 2.0)
    assert m[("ravn_peer_dropped_gradients_total", p)] == 2
    assert m[("ravn_peer_refused_packets_total", p)] == 1
    assert m[("ravn_peer_weight_version", p)] == 7
    assert m[("ravn_peer_in_flight_peak", p)] == 9
    assert m[("ravn_peer_kept_weights_peak_bytes", p)] == 4096
    assert m[("ravn_peer_held_gradients_peak_bytes", p)] == 1024
    buckets = {
        le: m[("ravn_peer_gradient_staleness_bucket", (("le", le), ("peer", "p1")))] for le in ("0", "1", "2", "+Inf")
    }
    assert buckets == {"0": 5, "1": 8, "2": 10, "+Inf": 10}
    assert m[("ravn_peer_gradient_staleness_count", p)] == 10
    assert m[("ravn_peer_gradient_staleness_sum", p)] == 3 + 2 * 2


def test_peer_before_any_update_shows_nan_not_zero(server: MetricsServer) -> None:
    server.peer("fresh")
    m = scrape(server.start(0))
    assert math.isnan(m[("ravn_peer_stage", (("peer", "fresh"),))])
    assert math.isnan(m[("ravn_peer_tokens_per_second", (("peer", "fresh"),))])
    assert m[("ravn_peer_gradient_staleness_bucket", (("le", "+Inf"), ("peer", "fresh")))] == 0


def test_coordinator_metrics_over_http(server: MetricsServer) -> None:
    clock = [0.0]
    run = server.coordinator("my-swarm", "run-1", clock=lambda: clock[0])
    run.set_total_steps(300)
    for step in range(5):
        clock[0] = float(step)
        run.on_step(step, 5.0 - step * 0.5, tokens=1000)
    run.on_eval(4, 3.25)
    run.set_peers({"online": 3, "joining": 1})
    run.set_uncovered_blocks(1)
    run.set_wire_bytes(2_500_000)
    m = scrape(server.start(0))
    assert m[("ravn_run_info", (("run", "run-1"), ("swarm", "my-swarm")))] == 1
    assert m[("ravn_run_step", ())] == 5
    assert m[("ravn_run_total_steps", ())] == 300
    assert m[("ravn_run_train_loss", ())] == 3.0
    assert m[("ravn_run_val_loss", ())] == 3.25
    assert m[("ravn_run_tokens_total", ())] == 5000
    assert m[("ravn_run_tokens_per_second", ())] == pytest.approx(1000.0)
    assert m[("ravn_run_peers", (("state", "online"),))] == 3
    assert m[("ravn_run_peers", (("state", "joining"),))] == 1
    assert m[("ravn_run_uncovered_blocks", ())] == 1
    assert m[("ravn_run_wire_bytes_per_token", ())] == 500
    run.set_peers({"online": 2})  # a state that disappears is not left behind at its old count
    assert ("ravn_run_peers", (("state", "joining"),)) not in scrape(server.port)


def test_two_servers_in_one_process_do_not_clash() -> None:
    with MetricsServer() as a, MetricsServer() as b:
        a.peer("alpha").update(stats(bytes_sent=1))
        b.peer("alpha").update(stats(bytes_sent=2))  # same names, separate registries
        b.coordinator("s", "r")
        pa, pb = a.start(0), b.start(0)
        assert pa != pb
        ma, mb = scrape(pa), scrape(pb)
        assert ma[("ravn_peer_sent_bytes_total", (("peer", "alpha"),))] == 1
        assert mb[("ravn_peer_sent_bytes_total", (("peer", "alpha"),))] == 2
        assert not any(name.startswith("ravn_run") for name, _ in ma)
    with pytest.raises(ValueError):  # a second collector with the same names in one registry is refused
        s = MetricsServer()
        s.peer("x")
        s.peer("y")


def test_stop_frees_the_port_and_start_twice_is_refused() -> None:
    s = MetricsServer()
    port = s.start(0)
    with pytest.raises(RuntimeError):
        s.start(0)
    s.stop()
    with MetricsServer() as again:
        assert again.start(port) == port


def test_stage_rates_survive_a_restart_and_missing_windows() -> None:
    then = stats(forward_micro_batches=100, bytes_sent=10_000, dropped=5, wall_seconds=50.0, idle_seconds=10.0)
    now = stats(forward_micro_batches=4, bytes_sent=1_000, dropped=0, wall_seconds=2.0, idle_seconds=1.0)
    r = stage_rates(then, now, 2.0, tokens_per_micro_batch=10)
    assert r.tokens_per_s == 20.0 and r.up_mbit_s == pytest.approx(1_000 * 8 / 1e6 / 2) and r.dropped == 0
    first = stage_rates(None, now, 0.0, 10)
    assert first.tokens_per_s is None and first.bubble_fraction == 0.5
