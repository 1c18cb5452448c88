"""A plain trace cut short while `diagnoser analyze` reads it: one sentence and exit 2, in one process (-j 1) and in
worker processes (-j 2, and the default), never a SIGBUS, a broken worker pool or a traceback.

The cut is made by the reader's test seam (parallel.CUT_WHILE_READ_ENV): the file is truncated for real, on disk,
after its events array is found and before its chunks are read, so the same reads meet the end of the file every
run."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diagnoser.traces import parallel
from diagnoser.traces.decode import TraceError
from diagnoser.traces.tables import scan_built

FIXTURE = Path(__file__).parent / "fixtures" / "traces" / "a100_ddp_2rank_nccl_rank0.json.gz"


def _plain(tmp_path: Path, at_least: int) -> Path:
    """The fixture as plain JSON, its events repeated until the file holds at least `at_least` bytes."""
    doc = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    events = json.dumps(doc.pop("traceEvents"))[1:-1].encode()
    copies = max(1, -(-at_least // len(events)))
    path = tmp_path / "trace.json"
    with open(path, "wb") as f:
        f.write(b'{"traceEvents": [')
        for i in range(copies):
            f.write(b"," if i else b"")
            f.write(events)
        f.write(b"], ")
        f.write(json.dumps(doc)[1:].encode())
    return path


def _analyze(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, parallel.CUT_WHILE_READ_ENV: str(path.stat().st_size // 2)}
    return subprocess.run([sys.executable, "-m", "diagnoser", "analyze", str(path), "--json", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def _one_sentence(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "BrokenProcessPool" not in proc.stderr
    assert "was cut short while it was read" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.skipif(not scan_built(), reason="one process reads a plain trace by offset only with the compiled scan; "
                                             "without it the file is streamed and a cut is read as a file cut short")
def test_one_process_meets_a_cut_as_one_sentence(tmp_path: Path) -> None:
    path = _plain(tmp_path, 4 << 20)
    whole = path.stat().st_size
    proc = _analyze(path, "-j", "1")
    _one_sentence(proc)
    assert path.stat().st_size == whole // 2


@pytest.mark.parametrize("jobs", [["-j", "2"], []], ids=["two-workers", "default"])
def test_worker_processes_meet_a_cut_as_one_sentence(tmp_path: Path, jobs: list[str]) -> None:
    path = _plain(tmp_path, parallel.MIN_PARALLEL_BYTES + (1 << 20))  # large enough to be read by workers
    whole = path.stat().st_size
    proc = _analyze(path, *jobs)
    if not jobs and not scan_built() and "cut short while" not in proc.stderr:
        pytest.skip("the default ran one process here, which streams the file without the compiled scan")
    _one_sentence(proc)
    assert path.stat().st_size == whole // 2


def test_a_read_past_the_end_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(b'{"traceEvents": []}' * 10)
    with parallel.PlainFile(path) as rd:
        assert rd.read(2, 6) == b"trac"
        os.truncate(path, 5)
        with pytest.raises(TraceError, match="cut short while it was read"):
            rd.read(0, 100)
