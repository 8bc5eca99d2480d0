"""``ravn local --wire-forward auto --wire-backward auto``: each link's codec from its measured bandwidth, end to end.

A real swarm on loopback (no mocks): one peer announces a 0.1 Mbit/s uplink (``--debug-slow-uplink``), so the
planner puts it at an end of the pipeline, where it sends one direction only, whichever is the smaller:

* gpt-medium (width 256): both directions may go to int3_rot (zstd-coded, the run's default), activations
  are the smaller (no fp32 scales), so it goes first and sends activations as int3_rot;
* gpt-tiny (width 64): below width 256 activations stop at int8 (4-bit ones cost more than 2% there) and
  gradients at int4_rot (int3_rot was not measured there), the int4_rot gradients are smaller, so it goes
  last and sends gradients as int4_rot.

Its link is link-bound; the link between the two loopback peers is bound by the slow stage, not by itself,
and keeps bf16. The summary names every link, and what each stage says it sent is what its links name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.wire_choice import FITS, LINK_BOUND
from swarm.config import MODEL_PRESETS, backward_ladder, forward_ladder
from tests.conftest import read_metrics, run_ravn_local


@pytest.mark.slow  # three peer processes start, measure and join: over 20 s on a shared machine
@pytest.mark.parametrize(
    ("model", "slow_stage", "direction", "smallest"),
    [("gpt-medium", 0, "forward", "int3_rot"), ("gpt-tiny", 2, "backward", "int4_rot")],
)
def test_auto_picks_a_codec_per_link_and_the_wire_uses_it(
    tmp_path: Path, model: str, slow_stage: int, direction: str, smallest: str
) -> None:
    run_ravn_local(
        tmp_path,
        "auto",
        *("--peers", "3", "--model", model, "--steps", "3", "--eval-every", "0", "--eval-batches", "1"),
        *("--wire-forward", "auto", "--wire-backward", "auto", "--debug-slow-uplink", "0:0.1"),
        timeout=300,
    )
    summary = next(m for m in read_metrics(tmp_path / "auto") if m["kind"] == "summary")
    assert (summary["wire_forward"], summary["wire_backward"]) == ("auto", "auto")
    stage_of = {s["peer"]: s["stage"] for s in summary["stages"]}
    links = {x["boundary"]: x for x in summary["links"]}
    assert sorted(links) == [0, 1] and all(x["stages"] == [i, i + 1] for i, x in links.items())
    width = MODEL_PRESETS[model].d_model
    ladder, back_ladder = forward_ladder(width, zstd=True), backward_ladder(width, zstd=True)
    for x in links.values():
        assert stage_of[x["upstream"]] == x["boundary"] and stage_of[x["downstream"]] == x["boundary"] + 1
        assert x["forward"] in ladder and x["backward"] in back_ladder
        assert x["forward_mbit_s"] > 0 and x["backward_mbit_s"] > 0
    assert stage_of["peer-0"] == slow_stage, f"the 0.1 Mbit/s uplink belongs at stage {slow_stage}: {stage_of}"
    slow = links[0 if slow_stage == 0 else 1]
    fast = links[1 if slow_stage == 0 else 0]  # loopback both ways, bound by the slow link: bf16 fits
    assert (slow[direction], slow[f"{direction}_reason"], slow[f"{direction}_mbit_s"]) == (smallest, LINK_BOUND, 0.1)
    other = "backward" if direction == "forward" else "forward"
    assert (slow[other], slow[f"{other}_reason"]) == ("bf16", FITS)  # towards the slow peer: its download is fast
    assert (fast["forward"], fast["forward_reason"]) == ("bf16", FITS)
    assert (fast["backward"], fast["backward_reason"]) == ("bf16", FITS)

    # what each stage reports it put on the wire is exactly what its links name
    sent = {s["stage"]: s["sent_codecs"] for s in summary["stages"]}
    assert set(sent[0]) == {f"forward:{links[0]['forward']}"}
    assert set(sent[1]) == {f"forward:{links[1]['forward']}", f"backward:{links[0]['backward']}"}
    assert set(sent[2]) == {f"backward:{links[1]['backward']}"}
    assert all(n > 0 for codecs in sent.values() for n in codecs.values())


@pytest.mark.slow  # three peer processes start, measure and join: over 20 s on a shared machine
def test_auto_error_feedback_follows_each_links_codec(tmp_path: Path) -> None:
    """``--error-feedback-backward auto`` (the default) with ``--wire-backward auto``: on where a link sends int3_rot.

    Two peers announce 0.1 Mbit/s uplinks, so the planner puts them at both ends: the last sends its gradients
    int3_rot (link-bound), the middle one sends bf16 gradients over loopback. Only the first of those links
    carries error feedback, as the summary and the peers' own logs say.
    """
    run_ravn_local(
        tmp_path,
        "ef",
        *("--peers", "3", "--model", "gpt-medium", "--steps", "3", "--eval-every", "0", "--eval-batches", "1"),
        *("--wire-forward", "auto", "--wire-backward", "auto", "--debug-slow-uplink", "0:0.1,1:0.1"),
        timeout=300,
    )
    summary = next(m for m in read_metrics(tmp_path / "ef") if m["kind"] == "summary")
    assert summary["error_feedback_backward"] == "auto"
    stage_of = {s["peer"]: s["stage"] for s in summary["stages"]}
    assert stage_of["peer-2"] == 1, f"the two slow uplinks belong at the ends: {stage_of}"
    links = {x["boundary"]: x for x in summary["links"]}
    assert (links[1]["backward"], links[1]["backward_error_feedback"]) == ("int3_rot", True)
    assert (links[0]["backward"], links[0]["backward_error_feedback"]) == ("bf16", False)
    logs = {p.stem: p.read_text() for p in (tmp_path / "ef" / "logs").glob("peer-*.log")}
    said = {peer: re.search(r"assigned stage .*\(error feedback ([^)]+)\)", text) for peer, text in logs.items()}
    assert all(said.values()), logs
    last = next(p for p, st in stage_of.items() if st == 2)
    assert said[last].group(1) == "on" and said["peer-2"].group(1) == "off"
