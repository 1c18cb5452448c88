"""The parallel reader (issue 20) gives exactly the serial result: on every public trace, plain (memory-mapped, cut
into ranges) and gzip (decompressed by the parent, chunks decoded by workers), with ranges and chunks made small
so that every trace is cut in many places; and on damaged traces."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from diagnoser.traces import TraceError, analyze_trace, parallel, tables
from diagnoser.traces.analysis import analyze_tables
from diagnoser.traces.parallel import collect_parallel, default_jobs, trace_jobs
from diagnoser.traces.tables import collect, scan_built

HERE = Path(__file__).resolve().parent
PUBLIC = sorted((HERE / "fixtures" / "traces").rglob("*.json.gz")) + sorted(
    (HERE / "fixtures" / "gpu" / "traces").glob("*.json.gz"))


def _canonical(path: Path, t: Any) -> bytes:
    d = analyze_tables(t).to_dict()
    d["decode"].pop("bytes_in")  # the mapped reader reads the file, the stream counts compressed bytes
    d.pop("path")
    d["summary"].pop("path")  # the same trace, plain or gzip
    return msgspec.json.encode(d, order="deterministic")


def _parallel(path: Path, **kw: Any) -> Any:
    return collect_parallel(path, jobs=2, min_bytes=0, **kw)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plain")


@pytest.mark.parametrize("path", PUBLIC, ids=[p.name for p in PUBLIC])
def test_parallel_equals_serial_on_every_public_trace(path: Path, plain_dir: Path) -> None:
    serial = _canonical(path, collect(path))
    # gzip: the parent decompresses and cuts 64 kB chunks, two workers decode them
    assert _canonical(path, _parallel(path, chunk_bytes=64 << 10)) == serial
    # plain: memory-mapped, cut into ranges of 200 kB read in 64 kB chunks
    plain = plain_dir / path.name.removesuffix(".gz")
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    assert _canonical(plain, _parallel(plain, chunk_bytes=64 << 10, range_bytes=200 << 10)) == serial


def test_only_the_first_external_ids_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # facts.sampling reads the first SAMPLE_IDS ids; the columns keep those (and the rest of their chunk), in order
    ops = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 10.0 * i, "dur": 5.0,
            "args": {"External id": 3 * i + 1, "Sequence number": i}} for i in range(60_000)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ops}))
    every = collect(path).ext_ids
    monkeypatch.setattr(tables, "SAMPLE_IDS", 500)
    serial = collect(path)
    assert 500 <= len(serial.ext_ids) < len(every) == 60_000
    split = _parallel(path, chunk_bytes=64 << 10, range_bytes=200 << 10)
    assert serial.ext_ids[:500] == split.ext_ids[:500] == every[:500]
    assert serial.counts == split.counts


def _events(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                    "ts": 100.0 * i, "dur": 5.0, "args": {"correlation": i}})
        out.append({"ph": "X", "cat": "kernel", "name": f"void k{i % 7}<float>()", "pid": 0, "tid": 7,
                    "ts": 100.0 * i + 20, "dur": 50.0 + i % 13, "args": {"device": 0, "stream": 7, "correlation": i}})
    return out


def test_damaged_and_odd_traces_read_the_same_in_parallel(tmp_path: Path) -> None:
    text = json.dumps({"schemaVersion": 1, "traceEvents": _events(3000)}, indent=1)
    nan = text.replace('"dur": 57.0', '"dur": NaN', 3).replace('"dur": 60.0', '"dur": -60.0', 5)
    cut = nan[: int(len(nan) * 0.83)]
    array_form = json.dumps(_events(2000))
    tricky = json.dumps({"traceEvents": _events(1500) + [
        {"ph": "X", "cat": "kernel", "name": 'k }, {"ph": "X"', "pid": 0, "tid": 7, "ts": 1e6, "dur": 1.0,
         "args": {"device": 0, "stream": 7, "correlation": 99999, "list": [{"a": 1}, {"ph": "X"}]}}],
        "distributedInfo": {"rank": 3, "pg_config": [{"x": 1}, {"y": 2}]}, "INFO": ["a]", "b]"]})
    for name, content in (("nan.json", nan), ("cut.json", cut), ("array.json", array_form), ("tricky.json", tricky)):
        path = tmp_path / name
        path.write_text(content)
        serial = _canonical(path, collect(path))
        assert _canonical(path, _parallel(path, chunk_bytes=16 << 10, range_bytes=64 << 10)) == serial, name
        gz = tmp_path / (name + ".gz")
        gz.write_bytes(gzip.compress(content.encode()))
        assert _canonical(gz, _parallel(gz, chunk_bytes=16 << 10)) == serial, name


def test_what_parallel_reads_is_what_it_says(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": _events(4000)}))
    t = _parallel(path, chunk_bytes=32 << 10, range_bytes=100 << 10)
    assert t.stats.events == 8000 and len(t.g_ts) == 4000 and len(t.r_ts) == 4000
    assert list(t.g_ts) == sorted(t.g_ts)  # parts appended in file order
    a = analyze_trace(path, jobs=2)
    assert a.summary.kernel_count == 4000 and a.summary.events_total == 8000


def test_bad_files_are_refused_the_same_way(tmp_path: Path) -> None:
    for content, message in ((b"", "is empty"), (b"garbage", "not a JSON trace"),
                             (b'{"other": 1}', "without a traceEvents array")):
        path = tmp_path / "bad.json"
        path.write_bytes(content)
        with pytest.raises(TraceError, match=message):
            collect_parallel(path, jobs=2, min_bytes=0)


def test_trace_jobs_takes_only_the_cores_the_load_leaves_idle() -> None:
    # this process's own core, plus each core the load average left idle, within the cores it may use
    assert trace_jobs(cores=2, load=0.2) == 2
    assert trace_jobs(cores=2, load=1.0) == 2
    assert trace_jobs(cores=2, load=1.5) == 1
    assert trace_jobs(cores=2, load=9.0) == 1
    assert trace_jobs(cores=16, load=4.5) == 12
    assert trace_jobs(cores=1, load=0.0) == 1
    assert 1 <= trace_jobs() <= default_jobs()


def test_others_running_is_read_now_and_the_load_average_is_the_fallback(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("7.50 7.00 6.00 4/312 12345\n")  # a minute of load, but 3 others running now (4, this one)
    monkeypatch.setattr(parallel, "_LOADAVG", loadavg)
    assert parallel.others_running(samples=2, pause_s=0) == 3.0
    monkeypatch.setattr(parallel, "default_jobs", lambda: 8)
    assert trace_jobs() == 6
    monkeypatch.setattr(parallel, "_LOADAVG", tmp_path / "absent")
    assert parallel.others_running() is None
    monkeypatch.setattr(parallel.os, "getloadavg", lambda: (7.5, 7.0, 6.0))
    assert trace_jobs() == 1


def test_busy_cores_read_a_large_trace_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(gzip.decompress((HERE / "fixtures" / "traces" / "a100_alexnet_forward.json.gz").read_bytes()))
    split: list[int] = []
    real = parallel._collect_mapped

    def mapped(*args: Any) -> Any:  # one process reads a mapped file too (the scan reads it where it lies)
        split.append(args[1])
        if args[1] > 1:
            raise AssertionError("read by several processes")
        return real(*args)

    monkeypatch.setattr(parallel, "default_jobs", lambda: 2)
    monkeypatch.setattr(parallel, "_collect_mapped", mapped)
    monkeypatch.setattr(parallel, "others_running", lambda: 6.0)  # both cores busy with other work
    assert collect_parallel(path, min_bytes=0).stats.events == collect(path).stats.events
    monkeypatch.setattr(parallel, "others_running", lambda: 0.0)  # both idle: two processes
    with pytest.raises(AssertionError, match="several processes"):
        collect_parallel(path, min_bytes=0)
    # (one process reads by offset only with the compiled scan; without it, the single pass streams the file)
    assert split == ([1, 2] if scan_built() else [2])


def test_default_jobs_and_small_files_stay_in_one_process(tmp_path: Path) -> None:
    assert default_jobs() >= 1
    path = tmp_path / "t.json"
    shutil.copy(HERE / "fixtures" / "traces" / "mi250-rocm-toy-train.json.gz", path.with_suffix(".gz"))
    assert collect_parallel(path.with_suffix(".gz")).stats.events == collect(path.with_suffix(".gz")).stats.events


def test_a_gzip_trace_on_two_idle_cores_is_read_in_one_process(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One process inflates a gzip stream for every parser: with only one parser beside it the parallel read cost
    more than it saved on two cores (benchmarks/TRACES.md), so by default it needs two parsers' worth of idle cores;
    asked for with -j, it still splits."""
    path = HERE / "fixtures" / "traces" / "a100_alexnet_forward.json.gz"
    split: list[int] = []

    def gz(*args: Any) -> Any:
        split.append(args[1])
        raise AssertionError("read by several processes")

    monkeypatch.setattr(parallel, "_collect_gzip", gz)
    monkeypatch.setattr(parallel, "others_running", lambda: 0.0)
    monkeypatch.setattr(parallel, "default_jobs", lambda: 2)
    assert collect_parallel(path, min_bytes=0).stats.events == collect(path).stats.events
    monkeypatch.setattr(parallel, "default_jobs", lambda: 4)  # three parsers' worth of idle cores: split
    with pytest.raises(AssertionError, match="several processes"):
        collect_parallel(path, min_bytes=0)
    with pytest.raises(AssertionError, match="several processes"):
        collect_parallel(path, min_bytes=0, jobs=2)
    assert split == [4, 2]
