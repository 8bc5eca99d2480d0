"""A failure that a restart cannot mend ends the run with its reason instead of recovering forever.

Tried as a new user would: ``ravn local --model CHECKPOINT --data small.jsonl`` with a file whose validation
split is shorter than the model's context. The peer's data source fails at its first batch ("val split of
50 tokens is shorter than the context 128");
the coordinator recovered, restarted the peer from step 0, met the same failure ten seconds later, and
went on like that until it was killed. The same failure again after a recovery, with no step done in
between, is not a fault of the moment: the run ends with it, in one line.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, ravn_cmd


@pytest.mark.slow  # ~40 s: a start, a recovery and the second failure; the default suite stays under 10 minutes
def test_a_data_file_shorter_than_the_context_ends_the_run_with_the_reason(tmp_path: Path) -> None:
    data = tmp_path / "small.txt"
    data.write_text("just over the corpus minimum of 1 KiB, so its validation split is shorter than a context\n" * 12)
    t0 = time.monotonic()
    proc = subprocess.run(
        ravn_cmd(
            "local",
            "--runs-dir",
            str(tmp_path),
            "--name",
            "small",
            "--model",
            "gpt-tiny",
            "--peers",
            "2",
            "--steps",
            "4",
            "--data",
            str(data),
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback" not in out
    failed = [line for line in proc.stdout.splitlines() if line.startswith("run failed:")]
    assert len(failed) == 1 and "shorter than the context" in failed[0], out
    assert out.count("recovering:") <= 1, out
    assert time.monotonic() - t0 < 150
