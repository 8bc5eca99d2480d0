"""``ravn plan`` as a user runs it (a real subprocess on a config.json, no weights) and its peer specs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coordinator import memory_model as mm
from coordinator.plan_command import DEFAULT_TFLOPS, SpecError, parse_peer, plan_report
from tests.conftest import ROOT, ravn_cmd
from tests.recipe_cli import recipe

LLAMA_70B = ROOT / "docs" / "configs" / "llama-3-70b.json"
TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 12,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def ravn_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(ravn_cmd("plan", *args), capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_peer_specs() -> None:
    p = parse_peer("24GiB,100mbit")
    assert p.memory == 24 * 2**30 and p.upload == p.download == 100e6 / 8
    assert p.flops == DEFAULT_TFLOPS * 1e12 and p.reachable
    p = parse_peer("12GB, 40mbit/10mbit, 80tflops, nat")
    assert (p.memory, p.upload, p.download, p.flops, p.reachable) == (12e9, 5e6, 1.25e6, 80e12, False)
    assert parse_peer("1.5TiB,1gbit").download == 1e9 / 8


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("24GiB", "want MEMORY,LINK"),
        ("24,100mbit", "memory '24'"),
        ("24GiB,100mbps", "link '100mbps'"),
        ("24GiB,/100mbit", "link ''"),
        ("24GiB,100mbit,fast", "unknown part 'fast'"),
        ("0GiB,100mbit", "must be positive"),
    ],
)
def test_bad_peer_specs_say_what_is_wrong_in_one_line(spec: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_peer(spec)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_plan_respects_every_peers_memory_and_names_its_bottleneck() -> None:
    arch = mm.Arch.from_config(TINY)
    settings = mm.Settings(micro_batch_size=2, context=256, in_flight=4)
    peers = [parse_peer(s) for s in ("4GiB,100mbit", "2GiB,20mbit/5mbit,nat", "8GiB,1gbit,100tflops")]
    report = plan_report(arch, settings, peers, wire_forward="int4_rot", wire_backward="int8", reserve=2**28)
    rows = report["stages"]
    assert [r["layers"][0] for r in rows][0] == 0 and rows[-1]["layers"][1] == 12
    for r in rows:
        assert r["total_bytes"] + 2**28 <= r["memory_bytes"] and r["headroom_bytes"] >= 0
        a, b = r["layers"]
        assert r["total_bytes"] == mm.block_memory(arch, settings, a, b).total
    assert report["tokens_per_second"] == pytest.approx(512 / report["seconds_per_micro_batch"])
    assert report["bottleneck"]["limited_by"] in ("compute", "upload", "download")
    assert report["boundary_bytes_per_token"] == {"forward": 256 * (0.5 + 2 / 64), "backward": 256 * (1 + 4 / 64)}


def test_ravn_plan_prints_a_table_and_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    peers = ["--peer", "4GiB,100mbit", "--peer", "4GiB,40mbit/10mbit", "--peer", "8GiB,1000mbit,80tflops"]
    proc = ravn_plan("--model", str(tmp_path), *peers, "--wire-forward", "int4_rot", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert sum(b - a for a, b in (r["layers"] for r in report["stages"])) == 12
    assert report["settings"]["context"] == 512  # min(512, the model's 2048 positions)
    assert report["tokens_per_second"] > 0
    table = ravn_plan("--model", str(tmp_path / "config.json"), *peers)
    assert table.returncode == 0, table.stderr
    for text in ("activations GiB", "tokens/s", "bottleneck: stage", "boundary bytes per token"):
        assert text in table.stdout


def test_the_plan_keeps_the_micro_batches_in_flight_that_the_schedule_does(tmp_path: Path) -> None:
    """A checkpoint's default, async capped at K in flight, keeps sync's K micro-batches; async's full window,
    (S + 1) x K, keeps twice sync's activations at S = 1: a plan for it must say so."""
    from typer.testing import CliRunner

    from coordinator.ravn_cli import app

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    peers = ["--peer", "4GiB,100mbit", "--peer", "4GiB,100mbit"]

    def planned(*flags: str) -> dict:  # in this process: the subprocess is test_ravn_plan_prints_a_table_and_json's
        result = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), *peers, "--json", *flags])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    default, sync, window = planned(), planned("--schedule", "sync"), planned("--in-flight", "8")
    assert [p["settings"]["in_flight"] for p in (default, sync, window)] == [4, 4, 8]
    # one set of defaults (swarm/config.py): the same flags plan what ravn local runs
    assert (4, 4, 8) == (
        recipe("--schedule", "async").in_flight_limit,
        recipe("--schedule", "sync").in_flight_limit,
        recipe("--schedule", "async", "--max-in-flight", "0").in_flight_limit,
    )
    assert planned("--max-staleness", "2", "--micro-batches", "3")["settings"]["in_flight"] == 3
    assert recipe("--schedule", "async", "--max-staleness", "2", "--micro-batches", "3").in_flight_limit == 3
    activations = [sum(s["activation_bytes"] for s in r["stages"]) for r in (default, window)]
    assert activations[1] > 1.3 * activations[0], activations  # all but the last stage keep twice as many
    bad = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), *peers, "--schedule", "gpipe"])
    assert bad.exit_code == 2 and "unknown schedule 'gpipe'" in bad.output, bad.output


def test_no_fit_is_one_line_with_the_memory_needed_and_exit_code_1() -> None:
    proc = ravn_plan("--model", str(LLAMA_70B), "--peer", "24GiB,100mbit", "--peer", "24GiB,100mbit")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "no plan fits" in proc.stderr and "needs >= " in proc.stderr and "GiB per peer for 40 layers" in proc.stderr
    bad = ravn_plan("--model", str(LLAMA_70B), "--peer", "24GiB")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "want MEMORY,LINK" in bad.stderr


def test_peers_that_cannot_be_arranged_are_one_line_too(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from coordinator.ravn_cli import app

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    nat = ["--peer", "4GiB,100mbit,nat"] * 2
    result = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), *nat])
    assert result.exit_code == 1 and "blocked on reachability" in result.output
    result = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--peer", "4GiB,1mbit", "--context", "4096"])
    assert result.exit_code == 2 and "exceeds the model's 2048 positions" in result.output


def test_auto_plans_with_the_smallest_codecs_and_reports_each_links_choice() -> None:
    """``ravn plan --wire-forward auto``: sized as if every link fell back to the smallest codec; the 1 Gbit/s
    link between two fast peers keeps bf16 while a 10 Mbit/s uplink sends the smallest."""
    arch = mm.Arch.from_config(TINY)
    settings = mm.Settings(micro_batch_size=2, context=256, in_flight=4)
    peers = [parse_peer(s) for s in ("8GiB,1gbit", "8GiB,1gbit", "8GiB,10mbit/1gbit")]
    report = plan_report(arch, settings, peers, wire_forward="auto", wire_backward="auto", stages=3, reserve=2**28)
    # gradients (~1e-7) travel with fp32 scales: 4 bytes per 64-element block
    # the smallest codec of the ladders (zstd on, the default), int3_rot: priced plain, as int4_rot, half a
    # byte per element and a scale per 64 elements
    assert report["boundary_bytes_per_token"] == {"forward": 256 * (0.5 + 2 / 64), "backward": 256 * (0.5 + 4 / 64)}
    links = {x["boundary"]: x for x in report["links"]}
    assert [p["peer"] for p in report["stages"]][0] == "pc2-8G"  # the slow uplink goes first: it sends least
    assert (links[0]["upstream"], links[0]["forward"], links[0]["forward_reason"]) == (
        "pc2-8G",
        "int3_rot",
        "smallest: link-bound",
    )
    # its gradients cross 1 Gbit/s, but the budget (the bottleneck without boundary 0, the rest sized with
    # int3_rot gradients) is too short for bf16's: the next codec that fits
    assert links[0]["forward_mbit_s"] == 10.0 and (links[0]["backward"], links[0]["backward_reason"]) == (
        "int8",
        "fits the bottleneck",
    )
    assert (links[1]["forward"], links[1]["backward"]) == ("bf16", "bf16")
