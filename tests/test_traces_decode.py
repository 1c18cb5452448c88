"""The streaming decoder and bad input: truncated files, gzip bombs, files that are not traces, events with missing
or mistyped fields, traces without GPU events. Each gives one clear sentence and exit 2, or a partial analysis that
says what it skipped."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diagnoser.cli.app import app
from diagnoser.errors import InputError
from diagnoser.traces import TraceError, analyze_trace
from diagnoser.traces.decode import iter_event_chunks

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
runner = CliRunner()


def _kernel(ts: float, dur: float, corr: int, name: str = "void gemm_kernel<float>()", stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": corr, "External id": corr}}


def _launch(ts: float, dur: float, corr: int, tid: int = 100) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": tid, "ts": ts,
            "dur": dur, "args": {"correlation": corr, "External id": corr}}


def _trace(events: list[dict], **meta: Any) -> dict:
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3",
                                                       "totalGlobalMem": 85520809984}], **meta,
            "traceEvents": events, "traceName": "hand-made"}


def _gpu_trace(n: int = 200, name: str = "void gemm_kernel<float>()") -> dict:
    events = []
    for i in range(n):
        events.append(_launch(100.0 * i, 5.0, i))
        events.append(_kernel(100.0 * i + 20, 50.0, i, name=name))
    return _trace(events)


def _write(path: Path, data: dict | list | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data, indent=1).encode())
    return path


def _all_events(path: Path, chunk_bytes: int) -> list[tuple]:
    _, chunks = iter_event_chunks(path, chunk_bytes=chunk_bytes)
    return [(e.ph.value, e.cat.value, e.name, e.ts, e.dur) for chunk in chunks for e in chunk]


# --- the decoder ------------------------------------------------------------------------------------------------

def test_chunk_size_does_not_change_the_events(tmp_path: Path) -> None:
    data = _gpu_trace(300)
    # names with the event separator inside strings: a cut there must never be taken
    data["traceEvents"][5]["name"] = 'void k<{lambda()#1}, {lambda()#2}>() }, { "ph": "X"'
    data["traceEvents"][7]["args"]["note"] = "},{},{"
    path = _write(tmp_path / "t.json", data)
    expected = [(e["ph"], e["cat"], e["name"], e["ts"], e["dur"]) for e in data["traceEvents"]]
    for chunk in (64, 257, 1024, 1 << 20):
        assert _all_events(path, chunk) == expected


def test_fixtures_decode_to_every_event(tmp_path: Path) -> None:
    for f in FIXTURES.glob("*.json.gz"):
        events = json.loads(gzip.decompress(f.read_bytes()))["traceEvents"]
        assert len(_all_events(f, 1 << 16)) == len(events)


def test_metadata_before_and_after_the_events_is_read(tmp_path: Path) -> None:
    data = _gpu_trace(3, )
    data["distributedInfo"] = {"rank": 3, "world_size": 8}
    data["baseTimeNanoseconds"] = 1711964646000000000  # written after traceEvents here
    path = _write(tmp_path / "t.json", data)
    a = analyze_trace(path)
    assert a.rank == 3 and a.world_size == 8 and a.base_time_ns == 1711964646000000000
    assert a.devices[0].name == "NVIDIA H100 80GB HBM3"


def test_json_array_format_and_concatenated_gzip_members(tmp_path: Path) -> None:
    events = _gpu_trace(50)["traceEvents"]
    raw = json.dumps(events).encode()
    path = _write(tmp_path / "array.json.gz", gzip.compress(raw[: len(raw) // 2]) + gzip.compress(raw[len(raw) // 2:]))
    a = analyze_trace(path)
    assert a.kernels is not None and a.kernels.kernels == 50
    assert a.summary.skipped == []


# --- bad input --------------------------------------------------------------------------------------------------

def test_truncated_json_gives_a_partial_analysis_that_says_so(tmp_path: Path) -> None:
    full = json.dumps(_gpu_trace(400), indent=1).encode()
    path = _write(tmp_path / "cut.json", full[: int(len(full) * 0.6)])
    a = analyze_trace(path)
    assert a.decode is not None and a.decode.truncated
    assert 0 < a.summary.kernel_count < 400
    assert any("truncated" in note for note in a.summary.skipped)


def test_truncated_gzip_gives_a_partial_analysis(tmp_path: Path) -> None:
    gz = gzip.compress(json.dumps(_gpu_trace(400), indent=1).encode())
    path = _write(tmp_path / "cut.json.gz", gz[: int(len(gz) * 0.7)])
    a = analyze_trace(path)
    assert 0 < a.summary.kernel_count < 400
    assert any("cut short" in note or "truncated" in note for note in a.summary.skipped)


def test_a_file_cut_before_any_event_is_an_input_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "head.json", b'{"schemaVersion": 1, "traceEvents": [ {"ph": "X", "na')
    with pytest.raises(TraceError, match="cut short"):
        analyze_trace(path)


def _bomb(path: Path, head: bytes, filler: bytes, size: int) -> Path:
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = filler * (1 << 20)
    with open(path, "wb") as f:
        f.write(comp.compress(head))
        f.writelines(comp.compress(block) for _ in range(size >> 20))
        f.write(comp.flush())
    return path


def test_gzip_bomb_of_whitespace_inside_the_events_is_refused(tmp_path: Path) -> None:
    path = _bomb(tmp_path / "bomb.json.gz", b'{"traceEvents": [', b" ", 300 << 20)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(TraceError, match="decompression bomb"):
        analyze_trace(path)


def test_gzip_of_zeros_is_not_a_trace(tmp_path: Path) -> None:
    path = _bomb(tmp_path / "zeros.json.gz", b"", b"\0", 64 << 20)
    with pytest.raises(TraceError, match="not a JSON trace"):
        analyze_trace(path)


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"   \n  ", "is empty"),
    (b"hello world", "not a JSON trace"),
    (b'{"format": "diagnoser-capture", "version": 1, "capture": {}}', "is a diagnoser capture, not a trace"),
    (b'{"format": "something-else", "events": []}', "without a traceEvents array"),
    (b'{"traceEvents": []}', "no events"),
    (gzip.compress(b"\x89PNG not json"), "not a JSON trace"),
])
def test_files_that_are_not_traces_are_input_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = _write(tmp_path / "x.json", content)
    with pytest.raises(TraceError, match=message):
        analyze_trace(path)
    assert issubclass(TraceError, InputError)


def test_missing_file_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no trace file"):
        analyze_trace(tmp_path / "absent.json")
    with pytest.raises(TraceError, match="holds no trace files"):
        analyze_trace(tmp_path)


def test_events_with_missing_or_mistyped_fields_are_skipped_and_counted(tmp_path: Path) -> None:
    data = _gpu_trace(100)
    ev = data["traceEvents"]
    del ev[1]["dur"]  # a kernel without a duration
    ev[3]["ts"] = "not a number"  # a mistyped start
    ev[5]["args"] = ["not", "an", "object"]  # args of the wrong type
    ev.append({"ph": "X", "cat": "kernel"})  # nothing but a category
    path = _write(tmp_path / "bad.json", data)
    a = analyze_trace(path)
    assert a.summary.kernel_count == 97
    notes = " ".join(a.summary.skipped)
    assert "unexpected type" in notes and "without a start or duration" in notes
    assert a.decode is not None and a.decode.bad_events == 2


def test_a_trace_with_no_gpu_events_is_a_partial_analysis(tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 10.0 * i, "dur": 5.0,
               "args": {"External id": i}} for i in range(20)]
    a = analyze_trace(_write(tmp_path / "cpu.json", _trace(events)))
    assert a.summary.gpu_busy_frac is None
    assert any("CPU-only" in note for note in a.summary.skipped)
    assert any("record_shapes" in note for note in a.summary.skipped)


def test_cli_says_one_sentence_and_exits_2(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.json", b"garbage")
    result = runner.invoke(app, ["analyze", str(path)])
    assert result.exit_code == 2
    assert result.output.strip().startswith("diagnoser: ")
    assert "Traceback" not in result.output
    assert result.output.strip().count("\n") == 0


def test_unknown_window_is_an_input_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", _gpu_trace(3))
    with pytest.raises(TraceError, match="unknown window"):
        analyze_trace(path, window="everything")


def test_whole_file_decode_reference_agrees_with_the_stream(tmp_path: Path) -> None:
    from diagnoser.traces.decode import decode_whole

    data = _gpu_trace(120)
    path = _write(tmp_path / "t.json.gz", gzip.compress(json.dumps(data).encode()))
    whole = [(e.ph.value, e.cat.value, e.name, e.ts, e.dur) for e in decode_whole(path)]
    assert whole == _all_events(path, 1 << 12)
