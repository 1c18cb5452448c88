"""Issue 28: a serving frontend's trace beside the ranks is not a rank; a rank whose file is cut short is not a
straggler; a gzip stream that inflates past the size limit is refused after about one plain inflate, not after the
parse reaches the limit; the temporal breakdown (compute / non-compute / idle) of HolisticTraceAnalysis, checked
against unions computed here from the raw events. Times are microseconds."""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diagnoser.cli.app import app
from diagnoser.pipeline import diagnose_capture
from diagnoser.traces import analyze_trace, capture_from_trace
from diagnoser.traces import decode as decode_mod
from diagnoser.traces import tables as tables_mod
from diagnoser.traces.decode import TraceError, _skip_ws

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
DDP = FIXTURES / "a100_ddp_2rank_nccl_rank0.json.gz"
runner = CliRunner()


def _kernel(ts: float, dur: float, corr: int, name: str = "void gemm_kernel<float>()", stream: int = 7,
            cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": corr}}


def _call(ts: float, corr: int) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts, "dur": 2.0,
            "args": {"correlation": corr}}


def _op(name: str, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": {}}


def _write(path: Path, events: list[dict[str, Any]], **meta: Any) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, **meta, "traceEvents": events}))
    return path


# --- item 4: a frontend in a folder of ranks ----------------------------------------------------------------------

def _worker(gpu: bool) -> list[dict[str, Any]]:
    """An engine worker: the model's ops and, on a GPU, their kernels."""
    evs: list[dict[str, Any]] = []
    for i in range(40):
        t = i * 100.0
        evs.append(_op("aten::linear", t, 60.0))
        evs.append(_op("aten::mm", t + 5, 50.0))
        if gpu:
            evs.append(_call(t + 10, i))
            evs.append(_kernel(t + 20, 40.0, i))
    return evs


def _frontend(ops: int) -> list[dict[str, Any]]:
    """vLLM's AsyncLLM process: a CPU profiler over request handling; no kernels, (next to) none of the model's ops."""
    evs = [{"ph": "X", "cat": "user_annotation", "name": f"request-{i}", "pid": 9, "tid": 9, "ts": i * 500.0,
            "dur": 400.0, "args": {}} for i in range(8)]
    evs += [_op("aten::empty", i * 500.0 + 10, 1.0) for i in range(ops)]
    return evs


@pytest.mark.parametrize(("gpu", "frontend_name", "ops"), [
    (True, "host_4242.async_llm.1733000000000.pt.trace.json", 0),  # vLLM's own name for it
    (True, "trace-b.json", 0),  # named like anything: no GPU events and no model ops beside GPU ranks
    (False, "host_4242.async_llm.1733000000000.pt.trace.json", 3),  # a CPU build: its few ops are not the model's
    (True, "0host_4242.async_llm.1733000000000.pt.trace.json", 0),  # sorted before the worker: the first file
])
def test_a_frontend_in_a_rank_folder_is_not_a_rank(tmp_path: Path, gpu: bool, frontend_name: str, ops: int) -> None:
    folder = tmp_path / "vllm_traces"
    folder.mkdir()
    worker = _write(folder / "dp0_pp0_tp0_dcp0_ep0_rank0.1733000000000.pt.trace.json", _worker(gpu))
    _write(folder / frontend_name, _frontend(ops))
    alone = analyze_trace(worker).summary
    a = analyze_trace(folder)
    s = a.summary
    assert [r.path.name for r in a.ranks] == [worker.name]
    assert [r.path for r in s.ranks] == [worker.name]
    assert len(s.frontends) == 1 and s.frontends[0].startswith(frontend_name + ": ")
    assert s.rank_count == 1
    assert s.gpu_busy_frac == alone.gpu_busy_frac  # not averaged with a CPU-only process
    assert s.kernel_count == alone.kernel_count
    assert s.timeline == alone.timeline and (s.timeline is not None) == gpu  # the first rank's window, drawn
    assert a.to_dict()["frontends"] == [str(folder / frontend_name)]
    result = runner.invoke(app, ["analyze", str(folder)])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if "frontend, not a rank" in ln]
    assert len(lines) == 1 and frontend_name in lines[0]
    assert "1 rank files: " + worker.name in result.output


def test_cpu_only_ranks_of_equal_work_stay_ranks(tmp_path: Path) -> None:
    for rank in (0, 1):
        _write(tmp_path / f"rank{rank}.json", _worker(gpu=False), distributedInfo={"rank": rank, "world_size": 2})
    s = analyze_trace(tmp_path).summary
    assert [r.rank for r in s.ranks] == [0, 1] and s.frontends == []


# --- item 8: a rank cut short is not a straggler -------------------------------------------------------------------

STEP_US = 1000.0


def _stepped_rank(rank: int) -> str:
    """Ten data-parallel steps: a compute-heavy first step (warm-up), then steps that mostly wait in the all-reduce.
    Host events first and GPU events after them, in Kineto's order (a cut file loses the last kernels first)."""
    host: list[dict[str, Any]] = []
    gpu: list[dict[str, Any]] = []
    for step in range(10):
        t0 = step * STEP_US
        compute = 900.0 if step == 0 else 300.0
        host.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 1}", "pid": 1, "tid": 1,
                     "ts": t0, "dur": STEP_US, "args": {}})
        host += [_call(t0 + 1, 2 * step + 1), _call(t0 + 4, 2 * step + 2)]
        gpu.append(_kernel(t0 + 10, compute, 2 * step + 1, name=f"void gemm_kernel_step{step}()"))
        gpu.append(_kernel(t0 + 10 + compute, STEP_US - 20 - compute, 2 * step + 2,
                           name="ncclDevKernel_AllReduce_Sum_f32_RING_LL", stream=9))
    return json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 2},
                       "traceEvents": host + gpu})


def test_a_rank_cut_short_is_not_named_a_straggler(tmp_path: Path) -> None:
    full = _write(tmp_path / "rank0.json", [])
    full.write_text(_stepped_rank(0))
    text = _stepped_rank(1)
    cut = tmp_path / "rank1.json"
    cut.write_text(text[:text.index('"void gemm_kernel_step2()"') + 10])  # in the middle of step 3's first kernel
    a = analyze_trace(tmp_path)
    s = a.summary
    by_rank = {r.rank: r for r in s.ranks}
    assert a.ranks[1].summary.truncated and a.ranks[1].summary.window_s < 0.5 * a.ranks[0].summary.window_s
    assert not any(r.straggler for r in s.ranks) and s.straggler == ""
    assert by_rank[1].compute_frac is None and by_rank[1].comm_frac is None
    assert by_rank[0].compute_frac is not None  # the whole rank keeps its numbers
    assert any("rank 1 is not compared" in note and "cut short" in note for note in s.skipped)
    outcome = diagnose_capture(capture_from_trace(a))
    assert "NET004" not in {f.code for f in outcome.diagnosis.findings}
    assert not any(fix.title == "Balance the ranks" for f in outcome.diagnosis.findings for fix in f.fixes)


def test_whole_ranks_are_still_compared(tmp_path: Path) -> None:
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text(_stepped_rank(rank))
    s = analyze_trace(tmp_path).summary
    assert all(r.compute_frac is not None for r in s.ranks)
    assert not any("is not compared" in note for note in s.skipped)


# --- item 9: a gzip stream past the limit is refused after about one plain inflate ----------------------------------

def _events_gzip(path: Path, blocks: int) -> Path:
    """Real-looking kernel events (times vary, so it compresses like a trace, under the bomb ratio)."""
    comp = zlib.compressobj(1, zlib.DEFLATED, 31)
    with open(path, "wb") as f:
        f.write(comp.compress(b'{"traceEvents": ['))
        for block in range(blocks):
            text = "".join(f'{{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": {i * 3.5}, '
                           f'"dur": 2.5, "args": {{"device": 0, "stream": 7, "correlation": {i}}}}}, '
                           for i in range(block * 30000, (block + 1) * 30000))
            f.write(comp.compress(text.encode()))
        f.write(comp.flush())
    return path


def _guards() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "diagnoser-inflate-guard" and t.is_alive()]


def _wait_for_no_guard(timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while _guards() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_an_inflate_past_the_limit_is_refused_before_the_parse_gets_there(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = _events_gzip(tmp_path / "bomb.json.gz", 12)  # about 40 MB of JSON against a 24 MiB limit
    real = tables_mod.read_chunk
    chunks: list[int] = []

    def slow_parse(t: tables_mod.Tables, data: bytes, mode: int, stats: decode_mod.DecodeStats, **kw: Any) -> int:
        # The parse is ten times slower than the inflate; here it is held until the count ahead of it has finished.
        chunks.append(len(data))
        _wait_for_no_guard()
        return real(t, data, mode, stats, **kw)

    monkeypatch.setattr(tables_mod, "read_chunk", slow_parse)
    with pytest.raises(TraceError, match=r"expands past 24\.0 MiB when decompressed"):
        analyze_trace(path, max_bytes=24 << 20, jobs=1)
    assert len(chunks) == 1  # refused after the first chunk, not after parsing up to the limit


def test_a_gzip_bomb_is_refused_in_one_sentence_exit_2(tmp_path: Path) -> None:
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    path = tmp_path / "bomb.json.gz"
    with open(path, "wb") as f:
        f.write(comp.compress(b'{"schemaVersion": 1, "traceEvents": ['))
        for _ in range(25):  # 200 MB of whitespace, a few hundred KB of gzip
            f.write(comp.compress(b" " * (8 << 20)))
        f.write(comp.compress(b"]}") + comp.flush())
    result = runner.invoke(app, ["analyze", str(path), "--max-trace-size", "32M", "-j", "1"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().count("\n") == 0
    assert "expands past 32.0 MiB when decompressed" in result.output


def test_a_gzip_trace_under_the_limit_reads_the_same_with_the_count_beside_it(tmp_path: Path) -> None:
    plain = _write(tmp_path / "t.json", _worker(gpu=True))
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    limit = plain.stat().st_size + 1  # small enough that the count runs (compressed size x 1000 > limit)
    assert gz.stat().st_size * decode_mod.MAX_GZIP_RATIO > limit
    a, b = analyze_trace(plain, max_bytes=limit), analyze_trace(gz, max_bytes=limit)
    assert a.summary.kernel_count == b.summary.kernel_count == 40
    assert a.summary.gpu_busy_frac == b.summary.gpu_busy_frac
    _wait_for_no_guard()
    assert not _guards()  # the count ends with the read


def test_whitespace_is_skipped_in_every_buffer_kind() -> None:
    import mmap

    for buf in (b"  \t\r\n{x", bytearray(b"  \t\r\n{x")):
        assert _skip_ws(buf, 0) == 5
        assert _skip_ws(buf, 1, 3) == 3
        assert _skip_ws(buf, 5) == 5
    with mmap.mmap(-1, 8) as mm:
        mm.write(b"   \n  {}")
        assert _skip_ws(mm, 0) == 6


# --- item 10: the temporal breakdown --------------------------------------------------------------------------------

def test_temporal_breakdown_of_overlapping_streams(tmp_path: Path) -> None:
    evs = [_call(0, 1), _call(3, 2), _call(6, 3),
           _kernel(0, 100, 1),  # compute
           _kernel(50, 100, 2, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL", stream=9),  # 50 of it beside compute
           _kernel(200, 50, 3, name="Memcpy DtoD (Device -> Device)", cat="gpu_memcpy", stream=11),
           _kernel(290, 10, 4)]
    s = analyze_trace(_write(tmp_path / "t.json", evs), window="gpu").summary
    assert s.compute_time_frac == pytest.approx(110 / 300)
    assert s.non_compute_time_frac == pytest.approx(100 / 300)
    assert s.idle_time_frac == pytest.approx(90 / 300)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total


def test_temporal_breakdown_matches_an_independent_union_on_a_real_trace() -> None:
    a = analyze_trace(DDP, jobs=1)
    s = a.summary
    w0, w1 = a.window
    events = json.loads(gzip.decompress(DDP.read_bytes()))["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    clipped = [(e, max(w0, e["ts"]), min(w1, e["ts"] + e["dur"])) for e in gpu]
    clipped = [(e, lo, hi) for e, lo, hi in clipped if hi > lo]
    busy = _union([(lo, hi) for _, lo, hi in clipped])
    comm = re.compile("nccl", re.IGNORECASE)
    compute = _union([(lo, hi) for e, lo, hi in clipped if e["cat"] == "kernel" and not comm.search(e["name"])])
    span = w1 - w0
    assert compute > 0 and busy - compute > 0  # a DDP step: both kinds ran
    assert s.compute_time_frac == pytest.approx(compute / span, rel=1e-6)
    assert s.non_compute_time_frac == pytest.approx((busy - compute) / span, rel=1e-6)
    assert s.idle_time_frac == pytest.approx(1 - busy / span, rel=1e-6)
    assert s.compute_time_frac + s.non_compute_time_frac == pytest.approx(s.gpu_busy_frac)  # type: ignore[operator]
    result = runner.invoke(app, ["analyze", str(DDP), "-j", "1", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)["context"]["trace"]["summary"]
    assert summary["compute_time_frac"] == pytest.approx(s.compute_time_frac)
    assert summary["idle_time_frac"] == pytest.approx(s.idle_time_frac)
    text = runner.invoke(app, ["analyze", str(DDP), "-j", "1"]).output
    assert (f"temporal breakdown: compute {s.compute_time_frac:.1%}, non-compute (communication, copies) "
            f"{s.non_compute_time_frac:.1%}, idle {s.idle_time_frac:.1%}") in text


def test_temporal_breakdown_of_a_folder_is_the_mean_of_its_ranks(tmp_path: Path) -> None:
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text(_stepped_rank(rank))
    a = analyze_trace(tmp_path)
    for name in ("compute_time_frac", "non_compute_time_frac", "idle_time_frac"):
        values = [getattr(r.summary, name) for r in a.ranks]
        assert getattr(a.summary, name) == pytest.approx(sum(values) / 2)


def test_a_capture_without_the_breakdown_still_loads() -> None:
    import msgspec

    from diagnoser.capture import TraceSummary

    old = msgspec.json.decode(b'{"path": "x", "window_s": 1.0, "gpu_busy_frac": 0.5}', type=TraceSummary)
    assert old.compute_time_frac is None and old.frontends == []
