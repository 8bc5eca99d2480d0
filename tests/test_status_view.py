"""coordinator.status_data, _verdict, _view: verdict rules, the JSON shape, the transport round trip, rich rendering."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from rich.console import Console

from coordinator.status_data import (
    LinkStatus,
    PeerStatus,
    RunStatus,
    SwarmStatus,
    blocks_from_peers,
    eta_seconds,
    peer_status_from_stats,
    staleness_percentile,
)
from coordinator.status_verdict import exit_code, status_json, verdict
from coordinator.status_view import render, sparkline
from swarm.pb import control_pb2 as cpb


def peer(name: str, block: tuple[int, int], **kw) -> PeerStatus:
    base = dict(
        device="cuda:0 RTX 3060",
        state="online",
        tokens_per_s=5000.0,
        up_mbit_s=42.0,
        down_mbit_s=40.5,
        staleness_counts=(90, 10),
        heartbeat_age_s=1.0,
        bubble_fraction=0.3,
    )
    return PeerStatus(name=name, block=block, **{**base, **kw})


def healthy(**run_kw) -> SwarmStatus:
    run = RunStatus(
        name="demo",
        step=120,
        total_steps=300,
        loss=2.41,
        val_loss=2.5,
        tokens_per_s=5123.0,
        eta_s=200.0,
        wire_bytes_per_token=1234.0,
        loss_history=(5.5, 4.0, 3.1, 2.8, 2.41),
        heartbeat_s=5.0,
        max_staleness=0,
    )
    run = replace(run, **run_kw)
    peers = (
        peer("p0", (0, 2), bubble_fraction=0.4),
        peer("p1", (2, 4), bubble_fraction=0.05),
        peer("p2", (4, 6), bubble_fraction=0.3),
    )
    return SwarmStatus(
        run=run,
        peers=peers,
        blocks=blocks_from_peers(peers, [(0, 2), (2, 4), (4, 6)]),
        swarm="my-swarm",
        generated_at=1_700_000_000.0,
    )


def with_peer(status: SwarmStatus, name: str, **kw) -> SwarmStatus:
    return replace(status, peers=tuple(replace(p, **kw) if p.name == name else p for p in status.peers))


def test_healthy_swarm() -> None:
    v = verdict(healthy())
    assert (v.level, v.line(), v.problems, exit_code(v)) == ("healthy", "healthy", (), 0)


def test_uncovered_block_is_broken_and_names_the_block() -> None:
    s = healthy()
    s = replace(s, blocks=tuple(replace(b, replicas=0) if b.layers == (2, 4) else b for b in s.blocks))
    v = verdict(s)
    assert v.level == "broken" and exit_code(v) == 2
    assert v.line().startswith("broken (layers [2,4) uncovered")
    assert v.problems[0].block == (2, 4)


def test_gap_in_the_plan_and_run_failure_are_broken() -> None:
    s = healthy()
    gap = replace(s, blocks=tuple(b for b in s.blocks if b.layers != (2, 4)))
    assert verdict(gap).level == "broken" and "[2,4) are in no block" in verdict(gap).line()
    failed = verdict(healthy(failure="peer p1: CUDA out of memory"))
    assert failed.level == "broken" and "CUDA out of memory" in failed.line()


def test_silent_peer_is_degraded_only_after_three_heartbeats() -> None:
    assert verdict(with_peer(healthy(), "p1", heartbeat_age_s=15.0)).level == "healthy"  # exactly 3: still fine
    v = verdict(with_peer(healthy(), "p1", heartbeat_age_s=16.0))
    assert v.level == "degraded" and exit_code(v) == 1
    assert v.line() == "degraded (layers [2,4): peer p1 silent for 16 s (over 3 heartbeats of 5 s))"
    assert v.problems[0].peer == "p1"


def test_rising_dropped_or_refused_is_degraded_but_old_totals_are_not() -> None:
    assert verdict(with_peer(healthy(), "p2", dropped=40, refused=3)).level == "healthy"
    dropped = verdict(with_peer(healthy(), "p2", dropped=41, dropped_recent=1))
    assert dropped.level == "degraded" and "dropped 1 stale gradients" in dropped.line()
    refused = verdict(with_peer(healthy(), "p0", refused=2, refused_recent=2))
    assert refused.level == "degraded" and "[0,2)" in refused.line() and "refused 2 packets" in refused.line()


def test_async_at_its_bound_is_healthy_and_drops_past_it_are_degraded() -> None:
    """S = 1 with most gradients one version late is the schedule working; a drop is a gradient lost."""
    at_bound = with_peer(healthy(max_staleness=1), "p1", staleness_counts=(14, 86))
    assert verdict(at_bound).level == "healthy"
    v = verdict(with_peer(at_bound, "p1", dropped=2, dropped_recent=2))
    assert v.level == "degraded" and "peer p1 dropped 2 stale gradients recently" in v.line()


def test_broken_outranks_degraded_and_the_rest_are_counted() -> None:
    s = with_peer(healthy(), "p0", heartbeat_age_s=60.0)
    s = replace(s, blocks=tuple(replace(b, replicas=0) if b.layers == (4, 6) else b for b in s.blocks))
    v = verdict(s)
    assert v.level == "broken" and v.line().endswith("; +1 more)")
    assert [p.severity for p in v.problems] == ["broken", "degraded"]


def test_no_plan_yet_is_degraded() -> None:
    v = verdict(SwarmStatus(run=RunStatus(name="r", step=0, total_steps=10)))
    assert v.level == "degraded" and "waiting for peers" in v.line()


def test_percentiles_eta_and_sparkline() -> None:
    assert staleness_percentile((), 0.5) is None
    assert staleness_percentile((90, 9, 1), 0.5) == 0
    assert staleness_percentile((90, 9, 1), 0.99) == 1
    assert staleness_percentile((0, 0, 5), 0.99) == 2
    assert eta_seconds(0, 100, 10.0) is None and eta_seconds(25, 100, 50.0) == 150.0
    spark = sparkline([5.0, 4.0, 3.0, 2.0, 1.0])
    assert spark == "█▆▅▃▁" and len(sparkline(list(range(1000)), width=20)) == 20
    assert sparkline([]) == "" and sparkline([2.0, 2.0]) == "▅▅"


def test_blocks_mark_the_busiest_stage_as_bottleneck() -> None:
    s = healthy()
    assert [b.bottleneck for b in s.blocks] == [False, True, False]
    lost = blocks_from_peers([peer("a", (0, 2), state="leaving"), peer("b", (2, 4))], [(0, 2), (2, 4)])
    assert [(b.replicas, b.covered, b.bottleneck) for b in lost] == [(0, False, False), (1, True, False)]
    told = blocks_from_peers([], [(0, 2), (2, 4)], replicas={(0, 2): 2})
    assert [(b.layers, b.replicas) for b in told] == [((0, 2), 2), ((2, 4), 0)]


def test_peer_status_from_two_reports() -> None:
    then = cpb.StageStats(
        forward_micro_batches=10, bytes_sent=0, bytes_received=0, dropped=1, wall_seconds=10, idle_seconds=5
    )
    now = cpb.StageStats(
        forward_micro_batches=20,
        bytes_sent=5_000_000,
        bytes_received=2_500_000,
        dropped=3,
        refused=0,
        kept_weights_bytes_peak=4096,
        held_gradient_bytes_peak=2048,
        staleness_counts=[8, 2],
        wall_seconds=20,
        idle_seconds=6,
    )
    p = peer_status_from_stats(
        name="p",
        device="cpu",
        block=(0, 3),
        state="online",
        now=now,
        then=then,
        window_s=10.0,
        heartbeat_age_s=0.5,
        tokens_per_micro_batch=256,
    )
    assert (p.tokens_per_s, p.up_mbit_s, p.down_mbit_s) == (256.0, 4.0, 2.0)
    assert (p.dropped, p.dropped_recent, p.refused_recent, p.bubble_fraction) == (3, 2, 0, 0.1)
    assert (p.staleness_p50, p.staleness_p99) == (0, 1)
    assert (p.kept_weights_bytes_peak, p.held_gradient_bytes_peak) == (4096, 2048)


def test_json_shape_is_stable_and_round_trips() -> None:
    s = with_peer(healthy(), "p1", heartbeat_age_s=20.0)
    d = json.loads(json.dumps(status_json(s), allow_nan=False))  # strict JSON: no NaN anywhere
    assert set(d) == {"schema", "swarm", "generated_at", "verdict", "run", "peers", "blocks", "excluded", "links"}
    assert d["schema"] == 1
    assert set(d["verdict"]) == {"level", "line", "problems"}
    assert d["verdict"]["problems"][0] == {
        "severity": "degraded",
        "why": d["verdict"]["problems"][0]["why"],
        "block": [2, 4],
        "peer": "p1",
    }
    assert set(d["run"]) == {
        "name",
        "step",
        "total_steps",
        "loss",
        "val_loss",
        "tokens_per_s",
        "eta_s",
        "wire_bytes_per_token",
        "loss_history",
        "heartbeat_s",
        "max_staleness",
        "failure",
        "recovering",
        "recovering_layers",
        "waiting",
    }
    assert set(d["peers"][0]) == {
        "name",
        "device",
        "block",
        "state",
        "tokens_per_s",
        "up_mbit_s",
        "down_mbit_s",
        "staleness_counts",
        "staleness_p50",
        "staleness_p99",
        "heartbeat_age_s",
        "dropped",
        "refused",
        "dropped_recent",
        "refused_recent",
        "bubble_fraction",
        "kept_weights_bytes_peak",
        "held_gradient_bytes_peak",
    }
    assert d["blocks"][1] == {"layers": [2, 4], "replicas": 1, "covered": True, "bottleneck": True}
    assert SwarmStatus.from_dict(d) == s  # the --json document parses back too (derived keys ignored)
    assert SwarmStatus.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_unknown_numbers_are_null_not_nan() -> None:
    s = SwarmStatus(run=RunStatus(name="r", step=0, total_steps=5, loss=float("nan"), tokens_per_s=float("inf")))
    d = status_json(s)
    assert d["run"]["loss"] is None and d["run"]["tokens_per_s"] is None
    json.dumps(d, allow_nan=False)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["peers"][0].update(block=[4, 2]), "status.peers[0].block: expected [a, b]"),
        (lambda d: d["run"].update(step="12"), "status.run.step: expected a non-negative integer"),
        (lambda d: d.update(peers={"p0": 1}), "status.peers: expected a list"),
        (lambda d: d.update(schema=2), "schema 2 is not supported"),
        (lambda d: d.pop("run"), "status.run: missing"),
        (lambda d: d["blocks"][0].update(bottleneck="yes"), "status.blocks[0].bottleneck: expected true or false"),
        (lambda d: d["peers"][1].update(staleness_counts=[1, -1]), "status.peers[1].staleness_counts[1]"),
    ],
)
def test_from_dict_names_the_bad_field(mutate, message: str) -> None:
    d = healthy().to_dict()
    mutate(d)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        SwarmStatus.from_dict(d)


def test_from_dict_ignores_unknown_keys() -> None:
    d = healthy().to_dict()
    d["future_field"] = {"x": 1}
    d["peers"][0]["gpu_temperature"] = 71
    assert SwarmStatus.from_dict(d) == healthy()


def test_render_shows_the_key_facts() -> None:
    s = with_peer(healthy(), "p1", heartbeat_age_s=20.0)
    s = with_peer(s, "p0", kept_weights_bytes_peak=3 * 2**20, held_gradient_bytes_peak=2**20)
    s = replace(s, blocks=tuple(replace(b, replicas=0) if b.layers == (4, 6) else b for b in s.blocks))
    console = Console(record=True, width=120, color_system=None)
    v = render(s, console)
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0].startswith("broken (layers [4,6) uncovered") and v.level == "broken"
    assert "run demo" in lines[1] and "step 120/300 (40%)" in lines[1] and "loss 2.410 █▅▃▂▁" in lines[1]
    assert "val 2.500" in lines[1] and "5,123 tok/s" in lines[1] and "ETA 3m 20s" in lines[1]
    assert "1,234 B/token" in lines[1]
    for fact in ("p0", "p1", "p2", "cuda:0 RTX 3060", "[2,4)", "42.0", "40.5", "20 s ago", "online"):
        assert fact in text
    p0 = next(line for line in lines if "│ p0 " in line)
    assert "90/10%" in p0 and "40%" in p0 and "4.0 MiB" in p0  # staleness, bubble, kept + held
    block_rows = {
        line.split("│")[1].strip(): line
        for line in lines
        if line.count("│") >= 4 and "[" in line and "cuda" not in line
    }
    assert "◀ bottleneck" in block_rows["[2,4)"] and "NO" in block_rows["[4,6)"]
    assert "degraded: peer p1 silent for 20 s" in text  # the second problem is listed below the tables


def test_render_before_any_step() -> None:
    console = Console(record=True, width=120, color_system=None)
    render(SwarmStatus(run=RunStatus(name="new", step=0, total_steps=300)), console)
    text = console.export_text()
    assert "degraded (no plan yet" in text and "- tok/s" in text and "ETA -" in text


def test_degraded_problems_are_ordered_most_urgent_first() -> None:
    s = with_peer(healthy(max_staleness=1), "p0", staleness_counts=(1, 99), dropped_recent=1)
    s = with_peer(s, "p2", heartbeat_age_s=30.0)
    whys = [p.why for p in verdict(s).problems]
    kinds = [w.split()[2] for w in whys]
    assert kinds == ["silent", "dropped"]


def test_recovery_is_degraded_and_names_the_block_even_while_it_is_uncovered() -> None:
    s = healthy(recovering="lost peer p1 (its control stream was cancelled)", recovering_layers=(2, 4))
    s = replace(s, blocks=tuple(replace(b, replicas=0) if b.layers == (2, 4) else b for b in s.blocks))
    v = verdict(s)
    assert v.level == "degraded" and exit_code(v) == 1
    assert v.line().startswith("degraded (layers [2,4): lost peer p1 (its control stream was cancelled); recovering")
    assert {p.severity for p in v.problems} == {"degraded"}
    back = SwarmStatus.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.run.recovering_layers == (2, 4) and verdict(back) == v
    assert SwarmStatus.from_dict(healthy().to_dict()).run.recovering_layers is None


def test_links_show_each_links_codecs_next_to_the_stages_and_round_trip() -> None:
    links = (
        LinkStatus(0, "p0", "p1", "int4_rot", "bf16", 10.0, 940.5, "smallest: link-bound", "fits the bottleneck"),
        LinkStatus(1, "p1", "p2", "bf16", "bf16", 940.5, 940.5, "fits the bottleneck", "fits the bottleneck"),
    )
    s = replace(healthy(), links=links)
    d = json.loads(json.dumps(status_json(s), allow_nan=False))
    assert d["links"][0] == {
        "boundary": 0,
        "upstream": "p0",
        "downstream": "p1",
        "forward": "int4_rot",
        "backward": "bf16",
        "forward_mbit_s": 10.0,
        "backward_mbit_s": 940.5,
        "forward_reason": "smallest: link-bound",
        "backward_reason": "fits the bottleneck",
        "backward_error_feedback": False,
    }
    assert SwarmStatus.from_dict(d) == s
    console = Console(record=True, width=160, color_system=None)
    render(s, console)
    rows = [line for line in console.export_text().splitlines() if "->" in line and "│" in line]
    assert len(rows) == 2
    assert "0 [0,2) -> 1 [2,4)" in rows[0] and "p0 -> p1" in rows[0] and "int4_rot" in rows[0]
    assert "10.0" in rows[0] and "smallest: link-bound; fits the bottleneck" in rows[0]
    assert "1 [2,4) -> 2 [4,6)" in rows[1] and rows[1].count("bf16") == 2 and "fits the bottleneck" in rows[1]


def test_a_links_error_feedback_shows_beside_its_backward_codec_and_round_trips() -> None:
    """``--error-feedback-backward`` is decided per link: ``ravn status`` says which links carry it."""
    links = (
        LinkStatus(0, "p0", "p1", "int3_rot", "int3_rot", backward_error_feedback=True),
        LinkStatus(1, "p1", "p2", "bf16", "bf16"),
    )
    s = replace(healthy(), links=links)
    d = json.loads(json.dumps(status_json(s), allow_nan=False))
    assert [x["backward_error_feedback"] for x in d["links"]] == [True, False]
    assert SwarmStatus.from_dict(d) == s
    del d["links"][0]["backward_error_feedback"]  # a coordinator from before the field: no feedback shown
    assert SwarmStatus.from_dict(d).links[0].backward_error_feedback is False
    console = Console(record=True, width=160, color_system=None)
    render(s, console)
    rows = [line for line in console.export_text().splitlines() if "->" in line and "│" in line]
    assert "int3_rot + error feedback" in rows[0] and "error feedback" not in rows[1], rows
