"""Waiting for a server's trace files: the engine worker's file, whole, not only the frontend's that came first.

`attach --trace` on a real vLLM (CPU build, a loaded host) analysed the frontend's small trace, written first, while
the worker was still writing its own: the capture's trace summary had no engine steps, where `diagnoser analyze` on
the same folder a moment later read 581.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

from diagnoser.tracing.endpoints import is_whole, wait_for_traces, worker_count

TRACE = {"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 5, "pid": 1, "tid": 1}] * 200}


def _text() -> bytes:
    return json.dumps(TRACE).encode()


def test_a_frontend_file_alone_is_not_the_trace(tmp_path: Path) -> None:
    """Written first: the frontend's file is on disk and still for longer than the settle time before the worker's
    appears; the wait returns both, the worker's among them."""
    since = time.time()
    (tmp_path / "host_11.async_llm.pt.trace.json").write_bytes(_text())

    def worker() -> None:
        time.sleep(3.0)  # longer than the settle time: the frontend alone looks complete meanwhile
        (tmp_path / "host_12.pt.trace.json").write_bytes(_text())

    t = threading.Thread(target=worker)
    t.start()
    files = wait_for_traces(tmp_path, since, timeout=120)
    t.join()
    assert worker_count(files) == 1 and len(files) == 2, files


def test_a_gzip_file_paused_mid_stream_is_waited_for(tmp_path: Path) -> None:
    """A worker that pauses longer than the settle time in the middle of its gzip stream: its size is still, its
    stream not ended; the wait returns once it ends, and the file it returns reads to its end."""
    since = time.time()
    path = tmp_path / "host_12.pt.trace.json.gz"
    data = _text()
    done = threading.Event()

    def worker() -> None:
        with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as gz:
            gz.write(data[: len(data) // 2])
            gz.flush()
            raw.flush()
            time.sleep(3.0)
            gz.write(data[len(data) // 2:])
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    files = wait_for_traces(tmp_path, since, timeout=120)
    t.join()
    assert done.is_set() and files == [path]
    assert json.loads(gzip.decompress(path.read_bytes())) == TRACE


def test_whole_and_cut_files_are_told_apart(tmp_path: Path) -> None:
    data = _text()
    plain, cut = tmp_path / "a.json", tmp_path / "b.json"
    plain.write_bytes(data + b"\n")
    cut.write_bytes(data[:-40])
    gz_whole, gz_cut = tmp_path / "c.json.gz", tmp_path / "d.json.gz"
    gz_whole.write_bytes(gzip.compress(data))
    gz_cut.write_bytes(gzip.compress(data)[:-30])
    empty = tmp_path / "e.json"
    empty.write_bytes(b"")
    assert [is_whole(p) for p in (plain, cut, gz_whole, gz_cut, empty)] == [True, False, True, False, False]


def test_after_the_timeout_what_is_there_is_returned(tmp_path: Path) -> None:
    """Only a frontend's file ever comes: the wait ends at its timeout with it (the caller says what is missing)."""
    since = time.time()
    front = tmp_path / "host_11.async_llm.pt.trace.json"
    front.write_bytes(_text())
    files = wait_for_traces(tmp_path, since, timeout=2.5)
    assert files == [front] and worker_count(files) == 0


def test_the_engines_own_step_split_reaches_the_evidence() -> None:
    """A vLLM CPU build's worker trace (the engine annotates every step with its prompt and decode counts; no GPU
    kernels to infer phases from): the evidence an attach with a trace diagnoses from carries the decode batch and
    the prefill share from those annotations."""
    from diagnoser.evidence_build import build_evidence
    from diagnoser.signals import TRACE_DECODE_BATCH, TRACE_PREFILL_FRAC
    from diagnoser.traces import analyze_trace, capture_from_trace

    fixture = Path(__file__).parent / "fixtures" / "traces" / "vllm-cpu-0.32-tiny-llama-250ms.json.gz"
    analysis = analyze_trace(fixture)
    steps = analysis.summary.engine_steps
    assert steps is not None and steps.steps > 0 and steps.decode_batch is not None
    ev = build_evidence(capture_from_trace(analysis))
    assert ev.signals[TRACE_DECODE_BATCH.name].mean == steps.decode_batch
    assert ev.signals[TRACE_PREFILL_FRAC.name].mean == steps.prefill_time_frac
