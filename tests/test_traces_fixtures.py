"""The real GPU traces in tests/fixtures/traces (A100, from HolisticTraceAnalysis' test data): timeline, idle
causes, NCCL and Triton kernels, cuda_sync handling. Expected numbers are recomputed here from the raw JSON with
the standard library, independently of the analysis, or taken from HTA where HTA is right."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from diagnoser.rules import diagnose
from diagnoser.traces import analyze_trace, capture_from_trace
from diagnoser.traces.analysis import TraceAnalysis
from tests.reference import union_us

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
ALEXNET = FIXTURES / "a100_alexnet_forward.json.gz"
DDP = FIXTURES / "a100_ddp_2rank_nccl_rank0.json.gz"
TRITON = FIXTURES / "a100_torch_compile_triton.json.gz"


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _events(path: Path) -> list[dict[str, Any]]:
    return json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]


@pytest.fixture(scope="module")
def alexnet() -> TraceAnalysis:
    return analyze_trace(ALEXNET)


@pytest.fixture(scope="module")
def ddp() -> TraceAnalysis:
    return analyze_trace(DDP)


@pytest.fixture(scope="module")
def triton() -> TraceAnalysis:
    return analyze_trace(TRITON)


def test_alexnet_busy_time_is_the_union_of_gpu_work_without_cuda_sync(alexnet: TraceAnalysis) -> None:
    events = _events(ALEXNET)
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS]
    syncs = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "cuda_sync"]
    assert len(syncs) == 41  # the trace has them; they must not count as GPU work
    lo, hi = min(s for s, _ in gpu), max(e for _, e in gpu)
    assert alexnet.window == (lo, hi)  # no ProfilerStep: the span of GPU activity
    (tl,) = alexnet.timelines
    assert tl.busy_us == pytest.approx(union_us(gpu, lo, hi), abs=1e-6)
    assert tl.busy_us < union_us(gpu + syncs, lo, hi)  # what HTA's temporal breakdown counts (pitfall P1)
    # HTA 0.5.0 reports 99.49 % idle on this trace; it is right here
    assert 1 - alexnet.summary.gpu_busy_frac == pytest.approx(0.9949, abs=0.0005)  # type: ignore[operator]


def test_alexnet_idle_causes(alexnet: TraceAnalysis) -> None:
    idle = alexnet.summary.idle_frac_by_cause
    assert set(idle) == {"host", "sync", "pageable_memcpy", "queue_dry", "kernel_overhead", "stream_wait"}
    assert sum(idle.values()) == pytest.approx(1 - alexnet.summary.gpu_busy_frac)  # type: ignore[operator]
    # the benchmark phases are separated by seconds of host work before the next launch
    assert idle["host"] > 0.99
    (tl,) = alexnet.timelines
    assert [g.cause for g in tl.longest_gaps[:3]] == ["host"] * 3
    # 16 copies from pageable memory, each followed by a cudaStreamSynchronize: the idle around them is theirs
    assert tl.gaps_by_cause["pageable_memcpy"] == 16
    assert idle["pageable_memcpy"] > 0


def test_alexnet_kernel_classes_and_copies(alexnet: TraceAnalysis) -> None:
    share = alexnet.summary.kernel_share
    assert sum(share.values()) == pytest.approx(1.0)
    # HTA: MEMORY 83.84 %, COMPUTATION 16.16 % of summed GPU time
    assert share["memcpy"] + share["memset"] == pytest.approx(0.8384, abs=0.001)
    assert share["comm"] == 0 and share["attention"] == 0
    k = alexnet.kernels
    assert k is not None and set(k.memcpy_us_by_direction) == {"HtoD"}
    top = {name: cls for name, cls, _, _ in k.top_kernels}
    assert top["ampere_sgemm_32x32_sliced1x4_tn"] == "gemm"
    assert top["cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1"] == "gemm"  # a cuDNN conv, not a ReLU
    assert k.launched == 79 and k.unlaunched == 0


def test_ddp_nccl_kernels_are_communication(ddp: TraceAnalysis) -> None:
    events = _events(DDP)
    nccl = [e for e in events if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    assert len(nccl) == 21
    k = ddp.kernels
    assert k is not None
    assert k.count_by_class["comm"] == len(nccl)
    nccl_us = sum(e["dur"] for e in nccl)
    assert k.time_us_by_class["comm"] == pytest.approx(nccl_us)
    assert ddp.comm_us > 0 and 0 < ddp.comm_overlapped_us < ddp.comm_us
    # HTA (last step included): COMMUNICATION 29.0 % of summed kernel time; ours 28.4 %: HTA rounds every
    # event to whole µs (ceil start, floor end), which shortens the many short compute kernels more.
    assert ddp.summary.kernel_share["comm"] == pytest.approx(0.284, abs=0.01)


def test_ddp_window_keeps_the_last_profiler_step(ddp: TraceAnalysis) -> None:
    steps = [e for e in _events(DDP) if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep")]
    assert len(steps) == 3
    last_end = max(e["ts"] + e["dur"] for e in steps)
    assert ddp.window[0] == min(e["ts"] for e in steps)
    assert ddp.window[1] >= last_end
    assert "last one kept" in ddp.window_policy
    # HTA with include_last_profiler_step=True: 76.68 % idle over 660.6 ms; ours starts at the first step's
    # start rather than its first kernel, and keeps sub-µs precision.
    assert 1 - ddp.summary.gpu_busy_frac == pytest.approx(0.764, abs=0.005)  # type: ignore[operator]
    assert ddp.summary.idle_frac_by_cause["host"] > 0.7


def test_ddp_launch_statistics_include_cudaLaunchKernelExC(ddp: TraceAnalysis) -> None:
    events = _events(DDP)
    launches = [e for e in events if e.get("cat") == "cuda_runtime"
                and e["name"] in ("cudaLaunchKernel", "cudaLaunchKernelExC")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(launches) == len(kernels) == 2700
    k = ddp.kernels
    assert k is not None and k.launched == 2700
    s = ddp.summary
    assert s.launch_call_us_p50 is not None and 5 < s.launch_call_us_p50 < 20
    assert s.launch_delay_us_p50 is not None and s.launch_delay_us_p50 >= 0
    assert s.short_kernel_frac is not None and 0 < s.short_kernel_frac < 1
    assert s.cuda_graph_launches == 0


def test_triton_driver_launch_and_the_launcher_op_is_not_gpu_work(triton: TraceAnalysis) -> None:
    k = triton.kernels
    assert k is not None and k.launched == 1  # cuLaunchKernel (driver API) counts like a runtime launch
    assert triton.summary.launch_call_us_p50 == pytest.approx(47.768)
    # The Triton launcher is a cpu_op with a "stream" arg and 95.8 µs duration; only the 1.76 µs kernel is GPU
    # work, kept at nanosecond resolution (HTA: 94 µs of compute, and the kernel rounded to 1 µs).
    (tl,) = triton.timelines
    assert tl.busy_us == pytest.approx(1.76, abs=1e-3)  # 1 ns: float64 resolves 0.25 ns at ts ~2.4e12 µs
    assert k.top_kernels[0][:2] == ("triton_poi_fused_add_cos_sin_0", "norm_elementwise")


def test_triton_step_that_outlives_the_profiler_is_clipped(triton: TraceAnalysis) -> None:
    events = _events(TRITON)
    (step,) = [e for e in events if e.get("name", "").startswith("ProfilerStep")]
    (span,) = [e for e in events if e.get("cat") == "Trace"]
    assert step["dur"] > 13e6  # written with a bogus 13 s duration
    assert triton.window[1] <= span["ts"] + span["dur"]
    assert triton.summary.window_s < 0.01


def test_fixture_captures_diagnose_as_host_bound(alexnet: TraceAnalysis, ddp: TraceAnalysis) -> None:
    for analysis in (alexnet, ddp):
        cap = capture_from_trace(analysis)
        assert cap.gpus and cap.gpus[0].name == "NVIDIA A100-PG509-200"
        d = diagnose(cap)
        # AlexNet's window is mostly one long pause, so its host-bound lean stays under the confidence a verdict
        # needs (tests/expectations/trace-a100-alexnet-forward.toml); the finding is there either way.
        assert d.verdict == "host_launch" or analysis is alexnet and d.verdict == "inconclusive"
        assert any(f.code == "HOST002" for f in d.findings)


def test_folder_with_the_fixtures_is_read_as_ranks(tmp_path: Path) -> None:
    for f in (DDP, TRITON):
        (tmp_path / f.name).symlink_to(f)
    a = analyze_trace(tmp_path)
    assert len(a.ranks) == 2
    assert a.summary.kernel_count == 2701
