"""The ranks of a folder read side by side: one worker process per rank file, the same analysis as one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from diagnoser.traces import parallel
from diagnoser.traces.analysis import TraceError, analyze_trace
from diagnoser.traces.parallel import each_file

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
RANKS = FIXTURES / "recsys-sampled-2of128"


def _pid_of(path: Path, jobs: int) -> tuple[str, int, int]:
    return path.name, jobs, os.getpid()


def test_each_file_gives_every_file_its_own_process_in_order(tmp_path: Path) -> None:
    files = [tmp_path / f"rank-{i}.json" for i in range(3)]
    got = each_file(_pid_of, files, jobs=2, min_bytes=0)
    assert [name for name, _, _ in got] == [f.name for f in files]
    assert all(jobs == 1 for _, jobs, _ in got)  # a worker reads its file alone: no pool inside a pool
    assert os.getpid() not in {pid for _, _, pid in got}


def test_each_file_reads_fewer_files_than_jobs_in_turn_on_every_job(tmp_path: Path) -> None:
    files = [tmp_path / "big.json"]
    assert each_file(_pid_of, files, jobs=4, min_bytes=0) == [("big.json", 4, os.getpid())]
    assert each_file(_pid_of, files + files, jobs=1, min_bytes=0) == [("big.json", 1, os.getpid())] * 2


def test_each_file_reads_small_files_in_this_process(tmp_path: Path) -> None:
    """Below the parallel threshold (a gzip file counted at ten times its size), starting workers costs more."""
    plain, packed = tmp_path / "rank-0.json", tmp_path / "rank-1.json.gz"
    plain.write_bytes(b"x" * 600)
    packed.write_bytes(b"\x1f\x8b" + b"x" * 98)
    files = [plain, packed]
    assert each_file(_pid_of, files, jobs=2, min_bytes=1601) == [("rank-0.json", 2, os.getpid()),
                                                                 ("rank-1.json.gz", 2, os.getpid())]
    assert os.getpid() not in {pid for _, _, pid in each_file(_pid_of, files, jobs=2, min_bytes=1600)}


def test_a_folder_of_ranks_reads_the_same_on_two_processes_as_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "MIN_PARALLEL_BYTES", 0)  # the fixture's ranks are small: read them in workers
    one = analyze_trace(RANKS, jobs=1).to_dict()
    two = analyze_trace(RANKS, jobs=2).to_dict()
    assert json.dumps(two, default=str, sort_keys=True) == json.dumps(one, default=str, sort_keys=True)
    assert one["summary"]["ranks"]


def test_a_bad_rank_file_read_in_a_worker_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "MIN_PARALLEL_BYTES", 0)
    for i in range(2):
        (tmp_path / f"rank-{i}.json").write_bytes((RANKS / "rank-0.json.gz").read_bytes() if i else b"")
    with pytest.raises(TraceError):
        analyze_trace(tmp_path, jobs=2)
