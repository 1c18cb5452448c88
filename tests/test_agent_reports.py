"""Run reports on disk: one folder per run, rotation, and no half-written report after `kill -9`."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diagnoser.agent.reports import RunReports, target_slug
from diagnoser.fileio import write_atomic

REPO = Path(__file__).resolve().parents[1]


def _run(reports: RunReports, target: str, started_at: float, payload: bytes = b"x") -> Path:
    staging = reports.staging(target)
    write_atomic(staging / "capture.dgc", payload)
    write_atomic(staging / "diagnosis.json", b"{}")
    return reports.finalize(staging, started_at)


def test_finalize_names_runs_by_utc_start(tmp_path: Path) -> None:
    reports = RunReports(tmp_path, keep=10)
    t = 1_790_000_000.0
    first = _run(reports, "llama", t)
    second = _run(reports, "llama", t + 0.5)  # the same second: a suffix, not an overwrite
    assert first.name == time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t)) and second.name == first.name + "-2"
    assert (first / "capture.dgc").read_bytes() == b"x" and (second / "diagnosis.json").is_file()
    assert oct(first.stat().st_mode & 0o777) == "0o700"  # private, as the history (0755 before)
    assert reports.runs("llama") == [first, second]


def test_rotation_keeps_the_newest(tmp_path: Path) -> None:
    reports = RunReports(tmp_path, keep=3)
    made = [_run(reports, "a/b c", 1_790_000_000.0 + i * 60) for i in range(6)]
    stale = reports.staging("a/b c")  # what a killed run leaves behind
    removed = reports.rotate("a/b c")
    assert reports.runs("a/b c") == made[3:]
    assert set(removed) == set(made[:3]) | {stale} and not stale.exists()
    # A staging folder still being written is left alone.
    busy = reports.staging("a/b c")
    reports.rotate("a/b c", busy=busy)
    assert busy.exists()
    assert target_slug("a/b c") == "a-b-c" and target_slug("../..") == "target"


# Builds report folders in a loop and prints each finished folder; killed at random moments.
_WRITER = r"""
import os, sys, time
from diagnoser.agent.reports import RunReports
from diagnoser.fileio import write_atomic
reports = RunReports(sys.argv[1], keep=1000)
i = 0
while True:
    i += 1
    staging = reports.staging("t")
    for name in ("capture.dgc", "diagnosis.json", "report.html"):
        write_atomic(staging / name, os.urandom(200_000))
    final = reports.finalize(staging, 1_790_000_000.0 + i)
    print(final, flush=True)
"""


@pytest.mark.slow
def test_kill_9_leaves_whole_reports_or_none(tmp_path: Path) -> None:
    rng = random.Random(3)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    finished: set[str] = set()
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                env=env)
        assert proc.stdout is not None
        finished.add(proc.stdout.readline().strip())
        time.sleep(rng.uniform(0.05, 0.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        finished |= {line.strip() for line in proc.stdout.read().splitlines() if line.strip()}
        reports = RunReports(tmp_path, keep=1000)
        runs = reports.runs("t")
        # Every reported folder is there, and every complete-looking folder holds all three whole files.
        assert finished <= {str(p) for p in runs}
        for folder in runs:
            files = sorted(p.name for p in folder.iterdir())
            assert files == ["capture.dgc", "diagnosis.json", "report.html"], (folder, files)
            assert all((folder / f).stat().st_size == 200_000 for f in files)
        # What the kill interrupted is only ever a hidden staging folder, which rotation clears.
        reports.rotate("t")
        assert not [p for p in (tmp_path / "t").iterdir() if p.name.startswith(".")]
