"""Trace facts on real traces (issues 13 and 16): platform, workload, steps, sampling, graph-replay and costed time
shares, top kernels, the duration distribution, the timeline window, collectives by kind, embedding and ROCm GEMM
classes, idle time of a GPU far behind its host, and the rank comparison.

Traces: the H100 windows in tests/fixtures/gpu/traces, and the public A100 and ROCm traces and windows in
tests/fixtures/traces (SOURCES.md says what each holds). Expected values come from what SOURCES.md says
the trace is, or are recomputed here from the raw JSON with the standard library."""

from __future__ import annotations

import gzip
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from diagnoser.capture import TraceSummary, dumps, load
from diagnoser.cli.app import app
from diagnoser.traces import analyze_trace, capture_from_trace
from diagnoser.traces.analysis import TraceAnalysis
from diagnoser.traces.snapshot import MAX_ITEMS
from diagnoser.traces.timeline import IDLE_CAUSES

HERE = Path(__file__).resolve().parent
PUBLIC = HERE / "fixtures" / "traces"
H100 = HERE / "fixtures" / "gpu" / "traces"
MI250 = PUBLIC / "mi250-rocm-toy-train.json.gz"
SGLANG = PUBLIC / "mi300x-sglang-qwen3-8b-decode.json.gz"
MI300_DDP = PUBLIC / "mi300x-ddp8-resnet-train-rank0-step16.json.gz"
RECSYS = PUBLIC / "a100-recsys-alltoall-16rank-rank0-step552.json.gz"
SAMPLED = PUBLIC / "recsys-sampled-2of128"
DDP = PUBLIC / "a100_ddp_2rank_nccl_rank0.json.gz"
ALEXNET = PUBLIC / "a100_alexnet_forward.json.gz"
TRITON = PUBLIC / "a100_torch_compile_triton.json.gz"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
runner = CliRunner()
_CACHE: dict[Path, TraceAnalysis] = {}


def analysis(path: Path) -> TraceAnalysis:
    if path not in _CACHE:
        _CACHE[path] = analyze_trace(path)
    return _CACHE[path]


def events(path: Path) -> list[dict[str, Any]]:
    return json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]


def window_ops(path: Path, cats: tuple[str, ...] = GPU_CATS) -> list[dict[str, Any]]:
    """The GPU events inside the analysed window (as the analysis chose it)."""
    w0, w1 = analysis(path).window
    return [e for e in events(path) if e.get("ph") == "X" and e.get("cat") in cats and e["ts"] < w1
            and e["ts"] + e["dur"] > w0]


# --- platform, workload, steps ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path, platform", [
    (MI250, "rocm"), (SGLANG, "rocm"), (MI300_DDP, "rocm"), (RECSYS, "cuda"), (SAMPLED / "rank-0.json.gz", "cuda"),
    (H100 / "h100-decode-b1-30ms.json.gz", "cuda"), (H100 / "h100-launch-30ms.json.gz", "cuda"),
])
def test_platform(path: Path, platform: str) -> None:
    assert analysis(path).summary.platform == platform


def test_platform_of_the_shared_a100_traces() -> None:
    for path in (DDP, ALEXNET, TRITON):
        assert analysis(path).summary.platform == "cuda"


@pytest.mark.parametrize("path, workload, evidence", [
    (MI250, "training", ("backward ops", "optimizer ops")),
    (MI300_DDP, "training", ("backward ops", "optimizer ops")),
    (RECSYS, "training", ("backward ops", "optimizer ops")),
    (SAMPLED / "rank-0.json.gz", "training", ("backward ops",)),
    (SGLANG, "inference", ("forward only", "serving markers", "graphs")),
    (H100 / "h100-decode-b1-30ms.json.gz", "inference", ("no backward or optimizer kernels",)),
    (H100 / "h100-launch-30ms.json.gz", "inference", ("forward only",)),
])
def test_workload_and_its_evidence(path: Path, workload: str, evidence: tuple[str, ...]) -> None:
    s = analysis(path).summary
    assert s.workload == workload
    text = " ".join(s.workload_evidence)
    for word in evidence:
        assert word in text


def test_workload_of_the_shared_a100_traces() -> None:
    ddp = analysis(DDP).summary
    assert ddp.workload == "training"
    assert any("gradient-style collectives" in e for e in ddp.workload_evidence)  # NCCL all-reduce beside backward
    assert analysis(ALEXNET).summary.workload == "inference"  # the forward-only PARAM benchmark
    assert analysis(TRITON).summary.workload == ""  # one kernel: too little to tell


@pytest.mark.parametrize("path", [MI250, RECSYS, SAMPLED / "rank-0.json.gz", SGLANG, H100 / "h100-launch-30ms.json.gz"])
def test_steps_count_distinct_profiler_steps(path: Path) -> None:
    names = {e["name"] for e in events(path) if e.get("cat") == "user_annotation"
             and e.get("name", "").startswith("ProfilerStep#")}
    assert analysis(path).summary.steps == (len(names) or None)


# --- sampling ---------------------------------------------------------------------------------------------------

def test_the_sampled_traces_are_called_sampled_and_no_other() -> None:
    for rank in ("rank-0.json.gz", "rank-1.json.gz"):
        s = analysis(SAMPLED / rank).summary
        assert s.sampled and "sample of the events" in s.sampled_reason
        assert any("incomplete" in n for n in s.skipped)
    whole = [MI250, SGLANG, MI300_DDP, RECSYS, *sorted(H100.glob("*.json.gz"))]
    whole += [DDP, ALEXNET, TRITON]
    for path in whole:
        s = analysis(path).summary
        assert not s.sampled, f"{path.name}: {s.sampled_reason}"


def _tiny(meta: dict[str, Any]) -> dict[str, Any]:
    evs = []
    for i in range(20):
        evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                    "ts": 100.0 * i, "dur": 5.0, "args": {"correlation": i}})
        evs.append({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 100.0 * i + 10, "dur": 50.0,
                    "args": {"device": 0, "stream": 7, "correlation": i}})
    return {"schemaVersion": 1, **meta, "traceEvents": evs}


@pytest.mark.parametrize("log, reason", [
    ({"WARNING": ["WARNING:2026-01-01 1:1 CuptiActivityApi.cpp:326] Dropped 1234 activity records"]},
     "dropped 1234 activity records"),
    ({"WARNING": [("WARNING:... CuptiActivityApi.cpp:161] Exceeded max GPU buffer count (1025 >= 1024) - "
                   "terminating tracing")]}, "stopped recording early"),
    ({"INFO": ["INFO:... Record counts: Out-of-range = 0, CUPTI stopped early? = 1"]}, "stopped recording early"),
])
def test_dropped_records_in_the_profiler_log_make_a_trace_sampled(tmp_path: Path, log: dict[str, Any],
                                                                   reason: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_tiny(log)))
    s = analyze_trace(path).summary
    assert s.sampled and reason in s.sampled_reason
    line = "INFO:... Record counts: Out-of-range = 4181, CUPTI stopped early? = 0"
    path.write_text(json.dumps(_tiny({"INFO": [line]})))
    assert not analyze_trace(path).summary.sampled


# --- graph replays, costed time -----------------------------------------------------------------------------------

def _graph_share(path: Path) -> float:
    """Kernel time in graph replays, from the raw JSON: kernels launched by cudaGraphLaunch/hipGraphLaunch or sharing
    their correlation id with other kernels (a replay's kernels all carry its launch's id)."""
    evs = events(path)
    graph_calls = {e["args"]["correlation"] for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver")
                   and e["name"] in ("cudaGraphLaunch", "hipGraphLaunch", "cuGraphLaunch")}
    kernels = list(window_ops(path, ("kernel",)))
    shared = {c for c, n in Counter(k["args"]["correlation"] for k in kernels).items() if n > 1}
    total = sum(k["dur"] for k in kernels)
    return sum(k["dur"] for k in kernels if k["args"]["correlation"] in shared | graph_calls) / total


@pytest.mark.parametrize("path", [H100 / "h100-decode-b1-30ms.json.gz", H100 / "h100-decode-b16-30ms.json.gz",
                                  H100 / "h100-decode-fp8-30ms.json.gz", SGLANG])
def test_a_decode_that_replays_graphs_shows_it(path: Path) -> None:
    s = analysis(path).summary
    assert s.graph_kernel_frac == pytest.approx(_graph_share(path), abs=1e-9)
    assert s.graph_kernel_frac >= 0.79  # issue 13: 79-100 % of such decodes' kernels run in graphs


def test_eager_traces_have_no_graph_time() -> None:
    for path in (H100 / "h100-launch-30ms.json.gz", MI250, MI300_DDP):
        assert analysis(path).summary.graph_kernel_frac == 0.0


def test_costed_time_is_the_kernel_time_launched_by_shaped_ops() -> None:
    launch = analysis(H100 / "h100-launch-30ms.json.gz").summary  # eager, record_shapes: some GEMMs costed
    assert launch.costed_time_frac is not None and 0.0 < launch.costed_time_frac < 1.0
    decode = analysis(H100 / "h100-decode-b1-30ms.json.gz").summary  # graph replays carry no shapes
    assert decode.costed_time_frac == 0.0
    # the top GEMM of the eager trace has FLOPs and an achieved rate from its launching op's shapes
    gemm = next(k for k in launch.top_kernels if k.kind == "gemm")
    assert gemm.costed_calls > 0 and gemm.flops_per_call and gemm.achieved_flop_per_s
    assert gemm.flops_per_call is not None and gemm.achieved_flop_per_s is not None
    assert gemm.achieved_flop_per_s == pytest.approx(gemm.flops_per_call * gemm.costed_calls /
                                                     (gemm.costed_calls * gemm.mean_us / 1e6), rel=0.5)


# --- kernel classes ---------------------------------------------------------------------------------------------

def _share_of(path: Path, keep: Any) -> float:
    ops = window_ops(path)
    return sum(e["dur"] for e in ops if keep(e["name"])) / sum(e["dur"] for e in ops)


def test_fbgemm_embedding_kernels_are_embedding_not_gemm() -> None:
    def fbgemm(name: str) -> bool:
        return any(w in name for w in ("split_embedding", "permute_2D", "permute_pooled", "bounds_check_indices",
                                       "permute_1D", "jagged"))
    for path in (RECSYS, SAMPLED / "rank-0.json.gz"):
        s = analysis(path).summary
        expected = _share_of(path, fbgemm)
        assert expected > 0
        assert s.kernel_share["embedding"] >= expected - 1e-9
        assert all(k.kind == "embedding" for k in s.top_kernels if fbgemm(k.full_name))


def test_tensile_gemms_are_gemm_on_rocm() -> None:
    for path in (MI250, SGLANG):
        s = analysis(path).summary
        cijk = [k for k in s.top_kernels if k.full_name.startswith("Cijk_")]
        assert cijk and all(k.kind == "gemm" for k in cijk)
        assert s.kernel_share["gemm"] >= _share_of(path, lambda n: n.startswith("Cijk_")) - 1e-9


def test_kernel_share_keys_are_the_documented_classes() -> None:
    keys = {"gemm", "attention", "embedding", "norm_elementwise", "reduction", "comm", "memcpy", "memset", "other"}
    for path in (MI250, RECSYS, SGLANG):
        s = analysis(path).summary
        assert set(s.kernel_share) == keys
        assert sum(s.kernel_share.values()) == pytest.approx(1.0)


# --- top kernels, durations, timeline --------------------------------------------------------------------------

@pytest.mark.parametrize("path", [RECSYS, SGLANG, MI300_DDP, H100 / "h100-decode-b1-30ms.json.gz"])
def test_top_kernels_match_the_raw_events(path: Path) -> None:
    s = analysis(path).summary
    ops = window_ops(path)
    by_name: dict[str, list[float]] = {}
    for e in ops:
        by_name.setdefault(e["name"], []).append(e["dur"])
    total = sum(e["dur"] for e in ops)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    assert 0 < len(s.top_kernels) <= 15
    assert [k.total_us for k in s.top_kernels] == pytest.approx([sum(d) for _, d in ranked[:len(s.top_kernels)]])
    for k in s.top_kernels:
        full = [n for n in by_name if n == k.full_name or (k.full_name.endswith("…") and n.startswith(k.full_name[:-1]))]
        assert len(full) == 1, k.full_name
        durs = sorted(by_name[full[0]])
        assert k.count == len(durs)
        assert k.share == pytest.approx(sum(durs) / total)
        assert k.p50_us == pytest.approx(statistics.median(durs))
        assert k.mean_us == pytest.approx(statistics.fmean(durs))
        assert k.p50_us <= k.p90_us <= max(durs)
        assert k.name and not k.name.startswith("void ") and len(k.name) <= 84
        assert "(" not in k.name or k.kind in ("memcpy", "memset")  # no parameter lists ("Memcpy DtoD (Device -> ...")


def test_duration_distribution() -> None:
    for path in (RECSYS, SGLANG, H100 / "h100-decode-b16-30ms.json.gz"):
        d = analysis(path).summary.kernel_duration_us
        durs = sorted(e["dur"] for e in window_ops(path, ("kernel",)))
        assert d is not None and d.count == len(durs)
        assert d.p50_us == pytest.approx(statistics.median(durs))
        assert d.max_us == pytest.approx(durs[-1])
        assert d.p10_us <= d.p50_us <= d.p90_us <= d.p99_us <= d.max_us
        assert sum(d.bin_counts) == len(durs) and len(d.bin_counts) == len(d.bin_edges_us) + 1
        assert sum(d.bin_time_us) == pytest.approx(sum(durs))


@pytest.mark.parametrize("path", [RECSYS, MI300_DDP, SGLANG, H100 / "h100-decode-b1-30ms.json.gz", MI250])
def test_timeline_window_is_compact_and_consistent(path: Path) -> None:
    tl = analysis(path).summary.timeline
    assert tl is not None and tl.items
    assert len(tl.items) <= MAX_ITEMS
    assert all(0 <= it.start_us <= tl.length_us + 1e-6 and it.dur_us >= 0 for it in tl.items)
    assert all(0 <= it.name < len(tl.names) for it in tl.items)
    assert all(g.cause in IDLE_CAUSES and g.dur_us > 0 for g in tl.gaps)
    steps = {e["name"] for e in events(path) if e.get("cat") == "user_annotation"
             and e.get("name", "").startswith("ProfilerStep#")}
    assert (tl.label in steps) if steps else tl.label == "middle of the GPU activity"
    # every op of the window's span is drawn unless the cap was reached
    if not tl.capped:
        inside = [e for e in events(path) if e.get("cat") in GPU_CATS and e["ts"] < tl.start_us + tl.length_us
                  and e["ts"] + e["dur"] > tl.start_us]
        assert len(tl.items) == len(inside)


def test_timeline_is_capped() -> None:
    tl = analysis(H100 / "h100-decode-fp8-30ms.json.gz").summary.timeline
    assert tl is not None and len(tl.items) <= MAX_ITEMS


# --- collectives, idle ------------------------------------------------------------------------------------------

def test_collective_shares_add_up_to_the_comm_share() -> None:
    for path in (RECSYS, SAMPLED / "rank-0.json.gz", MI300_DDP):
        s = analysis(path).summary
        assert set(s.comm_share_by_kind) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv",
                                             "other"}
        assert sum(s.comm_share_by_kind.values()) == pytest.approx(s.kernel_share["comm"])
    # the recommendation models' SendRecv kernels are named by the collective the host asked for
    rec = analysis(RECSYS).summary.comm_share_by_kind
    assert rec["all_to_all"] > 0 and rec["reduce_scatter"] > 0 and rec["all_reduce"] > 0
    assert analysis(SAMPLED / "rank-0.json.gz").summary.comm_share_by_kind["all_to_all"] > 0.2
    # RCCL's broadcasts say so in the kernel's "Collective name" (broadcast is "other")
    assert analysis(MI300_DDP).summary.comm_share_by_kind["other"] > 0


def test_ddp_gradient_all_reduce() -> None:
    s = analysis(DDP).summary
    nccl = _share_of(DDP, lambda n: n.startswith("ncclKernel_AllReduce"))
    assert s.comm_share_by_kind["all_reduce"] == pytest.approx(nccl, abs=1e-9)


def test_a_gpu_far_behind_its_host_waits_on_the_device_not_on_launches() -> None:
    # SOURCES.md: kernels start a median 164 ms after their launch calls: every gap is with work queued
    s = analysis(RECSYS).summary
    idle = s.idle_frac_by_cause
    assert idle["stream_wait"] > 10 * idle["kernel_overhead"]
    assert idle["stream_wait"] > idle["host"]


# --- ranks ------------------------------------------------------------------------------------------------------

def test_a_folder_of_ranks_is_compared_rank_by_rank() -> None:
    job = analyze_trace(SAMPLED)
    files = analyze_trace([SAMPLED / "rank-0.json.gz", SAMPLED / "rank-1.json.gz"])
    for a in (job, files):
        s = a.summary
        assert [r.rank for r in s.ranks] == [0, 1]
        for r, path in zip(s.ranks, ("rank-0.json.gz", "rank-1.json.gz"), strict=True):
            single = analysis(SAMPLED / path).summary
            assert r.path == path and r.gpu_busy_frac == pytest.approx(single.gpu_busy_frac)
            assert r.kernel_count == single.kernel_count
            assert r.comm_frac is not None and r.compute_frac is not None
            assert r.compute_frac + r.comm_exposed_frac == pytest.approx(r.gpu_busy_frac)  # type: ignore[operator]
        assert s.sampled and s.workload == "training" and s.platform == "cuda"
        assert s.kernel_count == sum(r.kernel_count for r in s.ranks)
        # the job's window is the first rank's, drawn; the other ranks carry no window of their own
        assert s.timeline is not None and s.timeline == analysis(SAMPLED / "rank-0.json.gz").summary.timeline
        assert a.snapshot is s.timeline
        ranks_json = a.to_dict()["ranks"]
        assert ranks_json[0]["summary"]["timeline"] is not None
        assert [r["summary"]["timeline"] for r in ranks_json[1:]] == [None]


def _rank_trace(rank: int, slow: float) -> dict[str, Any]:
    """A data-parallel step: compute, then an all-reduce that ends when the slowest rank arrives (at 1000 µs)."""
    compute = 600.0 * slow
    evs = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1200.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 1.0, "dur": 4.0,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 6.0, "dur": 4.0,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "void gemm_kernel()", "pid": 0, "tid": 7, "ts": 20.0, "dur": compute,
         "args": {"device": 0, "stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 9,
         "ts": 20.0 + compute, "dur": 1000.0 - compute, "args": {"device": 0, "stream": 9, "correlation": 2}},
    ]
    return {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 4}, "traceEvents": evs}


def test_a_straggler_stands_out(tmp_path: Path) -> None:
    files = []
    for rank, slow in enumerate((1.0, 1.0, 1.4, 1.02)):
        f = tmp_path / f"rank{rank}.json"
        f.write_text(json.dumps(_rank_trace(rank, slow)))
        files.append(f)
    s = analyze_trace(files).summary
    assert [r.straggler for r in s.ranks] == [False, False, True, False]
    assert s.straggler.startswith("rank 2 computes") and "communication" in s.straggler
    even = analyze_trace(files[:2] + [files[3]]).summary
    assert not any(r.straggler for r in even.ranks) and even.straggler == ""


def test_cli_takes_several_files_and_prints_the_ranks(tmp_path: Path) -> None:
    files = []
    for rank, slow in enumerate((1.0, 1.5)):
        f = tmp_path / f"rank{rank}.json"
        f.write_text(json.dumps(_rank_trace(rank, slow)))
        files.append(str(f))
    result = runner.invoke(app, ["analyze", *files])
    assert result.exit_code == 0, result.output
    assert "Ranks:" in result.output and "<- straggler" in result.output and "straggler: rank 1" in result.output
    result = runner.invoke(app, ["analyze", files[0], str(tmp_path / "absent.json")])
    assert result.exit_code == 2 and "no trace file" in result.output


# --- the summary travels in a capture ---------------------------------------------------------------------------

def test_new_fields_survive_a_capture_round_trip(tmp_path: Path) -> None:
    cap = capture_from_trace(analysis(RECSYS))
    path = tmp_path / "c.dgc"
    path.write_bytes(dumps(cap))
    back = load(path).trace
    assert back is not None
    assert msgspec.to_builtins(back) == msgspec.to_builtins(cap.trace)
    old = msgspec.json.decode(b'{"path": "x", "window_s": 1.0}', type=TraceSummary)  # a summary written before
    assert old.platform == "" and old.top_kernels == [] and old.timeline is None and old.steps is None
