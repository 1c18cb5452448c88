"""Cutting a short window out of a real trace (what `selftest --record` keeps as a fixture)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from diagnoser.traces import analyze_trace
from diagnoser.traces.decode import TraceError
from diagnoser.traces.trim import GPU_CATS, LEAD_US, trim_trace

H100_DECODE = Path(__file__).parent / "fixtures" / "gpu" / "traces" / "h100-decode-b1-30ms.json.gz"


def _doc(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def test_window_keeps_metadata_top_level_keys_and_only_its_events(tmp_path):
    out = tmp_path / "cut.json.gz"
    kept = trim_trace(H100_DECODE, out, window_ms=10.0, at=0.5)
    source, cut = _doc(H100_DECODE), _doc(out)
    assert set(cut) == set(source)  # deviceProperties, schemaVersion, ... all kept
    assert cut["deviceProperties"] == source["deviceProperties"]
    assert len(cut["traceEvents"]) == kept < len(source["traceEvents"])
    starts = sorted(e["ts"] for e in source["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    t0 = starts[len(starts) // 2]
    timed = [e for e in cut["traceEvents"] if e.get("ph") != "M"]
    assert timed and all(t0 - LEAD_US <= e["ts"] and e["ts"] + e.get("dur", 0) <= t0 + 10_000 for e in timed)
    assert {e["name"] for e in cut["traceEvents"] if e.get("ph") == "M"} == \
        {e["name"] for e in source["traceEvents"] if e.get("ph") == "M"}
    as_text = [json.dumps(e, sort_keys=True) for e in timed]
    wanted = set(as_text)
    in_source = [t for t in (json.dumps(e, sort_keys=True) for e in source["traceEvents"]) if t in wanted]
    assert in_source == as_text  # copied as they were, in order
    assert analyze_trace(out).summary.kernel_count > 0


def test_bad_inputs_are_one_sentence(tmp_path):
    no_gpu = tmp_path / "cpu.json"
    no_gpu.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1,
                                                   "dur": 2, "pid": 1, "tid": 1}]}))
    with pytest.raises(TraceError, match="has no GPU events"):
        trim_trace(no_gpu, tmp_path / "x.json.gz")
    cut_short = tmp_path / "short.json.gz"
    cut_short.write_bytes(H100_DECODE.read_bytes()[:5000])
    with pytest.raises(TraceError, match="cut short"):
        trim_trace(cut_short, tmp_path / "y.json.gz")
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello")
    with pytest.raises(TraceError, match="not a Kineto trace"):
        trim_trace(not_json, tmp_path / "z.json.gz")
    with pytest.raises(TraceError, match="window must be positive"):
        trim_trace(H100_DECODE, tmp_path / "w.json.gz", window_ms=0)
