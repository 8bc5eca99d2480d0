"""A fault a peer reports about a block of a plan the run has left does not start another recovery.

CI's slow suite once failed a recovery test (1 run in 5 on a loaded machine): the coordinator re-planned
and sent each survivor its new block, one after the other. The peer served first dropped its old links;
the other, still holding its old block, saw its downstream close the link and reported that as a fault.
The coordinator, already on the new plan, took it for a new failure and recovered again (and again),
until the run failed with three steps trained. A report now names the plan epoch of the block its error
is about; an error of an epoch older than the run's is logged and dropped.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from peer.reports import Reporter, merge_reports
from swarm.pb import control_pb2 as cpb
from tests.test_report_once import make_run


def _error(epoch: int) -> cpb.StatusReport:
    return cpb.StatusReport(peer_id="p0", error="downstream peer p1 closed the link", error_epoch=epoch)


def test_an_error_about_a_left_plan_is_dropped(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    run.store.begin_epoch(0)
    run.store.begin_epoch(0)  # a recovery re-planned: the run is at epoch 2
    run.reports.on_report(_error(1))
    assert run.flow.failure is None and not run.flow.failed.is_set()


def test_an_error_about_the_current_plan_or_no_block_fails_over(tmp_path: Path) -> None:
    for epoch in (2, 0):  # the current block's fault; a fault of the peer itself (no block to name)
        run = make_run(tmp_path / str(epoch))
        run.store.begin_epoch(0)
        run.store.begin_epoch(0)
        run.reports.on_report(_error(epoch))
        assert run.flow.failed.is_set() and "closed the link" in (run.flow.failure or "")


def test_a_merged_report_keeps_the_epoch_of_its_first_error() -> None:
    first = cpb.StatusReport(peer_id="p0", error="first", error_epoch=1)
    merged = merge_reports(None, first)
    merged = merge_reports(merged, cpb.StatusReport(peer_id="p0", error="second", error_epoch=2))
    assert (merged.error, merged.error_epoch) == ("first", 1)
    merged = merge_reports(merge_reports(None, cpb.StatusReport(peer_id="p0")), first)
    assert (merged.error, merged.error_epoch) == ("first", 1)


def test_a_stage_reports_its_faults_with_its_assignments_epoch() -> None:

    sent: list[cpb.StatusReport] = []

    class _Control:
        async def Report(self, msg: cpb.StatusReport, timeout: float) -> cpb.ReportReply:  # noqa: N802
            sent.append(msg)
            return cpb.ReportReply()

    reporter = Reporter(
        "p0",
        cpb.StageStats,
        type("Q", (), {"status": lambda self: {}})(),
        type("M", (), {"update": lambda self, s: None})(),
        lambda: _Control(),
        lambda: True,
    )
    asyncio.run(reporter.fail("link lost", epoch=3))
    assert [(m.error, m.error_epoch) for m in sent] == [("link lost", 3)]
