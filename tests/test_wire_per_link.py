"""``ravn local --wire-forward auto --wire-backward auto``: each link's codec from its measured bandwidth, end to end.

A real swarm on loopback (no mocks): one peer announces a 0.1 Mbit/s uplink (``--debug-slow-uplink``), so the
planner puts it first (it then sends only activations, the smaller tensors) and its link gets the smallest
activation codec, while the link between the two loopback peers is bound by the slow stage, not by itself,
and keeps bf16. The summary names every link, and what each stage says it sent is what its links name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.wire_choice import FITS, LINK_BOUND
from swarm.config import AUTO_BACKWARD_LADDER, AUTO_FORWARD_LADDER
from tests.conftest import read_metrics, run_ravn_local


@pytest.mark.slow  # three peer processes start, measure and join: over 20 s on a shared machine
def test_auto_picks_a_codec_per_link_and_the_wire_uses_it(tmp_path: Path) -> None:
    run_ravn_local(
        tmp_path,
        "auto",
        *("--peers", "3", "--model", "gpt-tiny", "--steps", "3", "--eval-every", "0", "--eval-batches", "1"),
        *("--wire-forward", "auto", "--wire-backward", "auto", "--debug-slow-uplink", "0:0.1"),
        timeout=300,
    )
    summary = next(m for m in read_metrics(tmp_path / "auto") if m["kind"] == "summary")
    assert (summary["wire_forward"], summary["wire_backward"]) == ("auto", "auto")
    stage_of = {s["peer"]: s["stage"] for s in summary["stages"]}
    links = {x["boundary"]: x for x in summary["links"]}
    assert sorted(links) == [0, 1] and all(x["stages"] == [i, i + 1] for i, x in links.items())
    for x in links.values():
        assert stage_of[x["upstream"]] == x["boundary"] and stage_of[x["downstream"]] == x["boundary"] + 1
        assert x["forward"] in AUTO_FORWARD_LADDER and x["backward"] in AUTO_BACKWARD_LADDER
        assert x["forward_mbit_s"] > 0 and x["backward_mbit_s"] > 0
    slow = links[0]
    assert slow["upstream"] == "peer-0", "the 0.1 Mbit/s uplink belongs first: it then sends only activations"
    smallest = AUTO_FORWARD_LADDER[-1]  # int4_rot
    assert (slow["forward"], slow["forward_reason"], slow["forward_mbit_s"]) == (smallest, LINK_BOUND, 0.1)
    fast = links[1]  # loopback both ways, and the pipeline is bound by the slow link: bf16 fits
    assert (fast["forward"], fast["forward_reason"]) == ("bf16", FITS)
    assert (fast["backward"], fast["backward_reason"]) == ("bf16", FITS)

    # what each stage reports it put on the wire is exactly what its links name
    sent = {s["stage"]: s["sent_codecs"] for s in summary["stages"]}
    assert set(sent[0]) == {f"forward:{smallest}"}
    assert set(sent[1]) == {f"forward:{fast['forward']}", f"backward:{slow['backward']}"}
    assert set(sent[2]) == {f"backward:{fast['backward']}"}
    assert all(n > 0 for codecs in sent.values() for n in codecs.values())
