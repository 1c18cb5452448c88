"""Real traces made here by a real torch model on the CPU (prefill + decode, record_shapes), analysed end to end."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from diagnoser.capture import dumps, loads
from diagnoser.rules import diagnose
from diagnoser.traces import analyze_trace, capture_from_trace
from diagnoser.traces.analysis import TraceAnalysis
from tests import traces_workload as w

BATCH, PROMPT, DECODE = 2, 16, 6


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu-traces")


@pytest.fixture(scope="module")
def stepped(trace_dir: Path) -> Path:
    return w.profile_generation(trace_dir / "stepped.json", batch=BATCH, prompt=PROMPT, decode_steps=DECODE)


@pytest.fixture(scope="module")
def stepped_analysis(stepped: Path) -> TraceAnalysis:
    return analyze_trace(stepped)


def test_flops_of_the_generation_are_exact(stepped_analysis: TraceAnalysis) -> None:
    ops = stepped_analysis.ops
    assert ops is not None and ops.uncosted == 0
    assert ops.total_flops == w.expected_flops(BATCH, PROMPT, DECODE)
    # Only the outermost op is costed: aten::linear, not the addmm/matmul/mm inside it; sdpa, not its math ops.
    assert set(ops.by_op) == {"aten::linear", "aten::scaled_dot_product_attention"}
    steps = DECODE + 1
    assert ops.by_op["aten::linear"]["count"] == steps * (w.LAYERS * 4 + 1)
    assert ops.by_op["aten::scaled_dot_product_attention"]["count"] == steps * w.LAYERS
    assert ops.dtype == "fp32" and ops.time_basis == "cpu"


def test_linear_bytes_and_intensity_follow_the_shapes(stepped_analysis: TraceAnalysis) -> None:
    ops = stepped_analysis.ops
    assert ops is not None
    d = w.D_MODEL
    # The first qkv projection of the prefill: input [B, P, D], weight [3D, D], bias [3D], fp32.
    first = next(r for r in ops.runs if r.name == "aten::linear")
    m = BATCH * PROMPT
    assert first.cost.flops == 2 * m * d * 3 * d
    assert first.cost.bytes == 4 * (m * d + 3 * d * d + m * 3 * d + 3 * d)
    assert first.cost.tokens == m
    assert 0 < stepped_analysis.summary.intensity_flop_per_byte < 1000


def test_prefill_and_decode_steps_are_found(stepped_analysis: TraceAnalysis) -> None:
    ph = stepped_analysis.phases
    assert ph is not None and ph.source == "ProfilerStep"
    assert [s.phase for s in ph.steps] == ["prefill"] + ["decode"] * DECODE
    assert ph.steps[0].tokens == BATCH * PROMPT and ph.steps[0].q_len == PROMPT
    assert all(s.tokens == BATCH and s.batch == BATCH and s.q_len == 1 for s in ph.steps[1:])
    # the context each decode step attends over grows by one token per step
    assert [s.kv_len for s in ph.steps] == [PROMPT] + [PROMPT + k for k in range(1, DECODE + 1)]
    s = stepped_analysis.summary
    assert s.decode_batch == BATCH
    assert s.prefill_frac is not None and 0 < s.prefill_frac < 1
    assert s.attention_frac is not None and 0 < s.attention_frac < 1
    assert ph.context_growth is not None
    assert ph.context_growth[0][0] == PROMPT + 1 and ph.context_growth[1][0] == PROMPT + DECODE


def test_last_profiler_step_is_kept(stepped_analysis: TraceAnalysis) -> None:
    ph = stepped_analysis.phases
    assert ph is not None
    assert ph.steps[-1].name == f"ProfilerStep#{DECODE}"
    assert stepped_analysis.window[1] >= ph.steps[-1].end
    assert "last one kept" in stepped_analysis.window_policy


def test_cpu_only_trace_says_what_it_could_not_measure(stepped_analysis: TraceAnalysis) -> None:
    s = stepped_analysis.summary
    assert s.gpu_busy_frac is None and s.kernel_share == {} and s.devices == []
    assert any("CPU-only trace" in note for note in s.skipped)


def test_capture_from_trace_is_diagnosable_and_round_trips(stepped_analysis: TraceAnalysis) -> None:
    cap = capture_from_trace(stepped_analysis)
    assert cap.target == f"trace {stepped_analysis.path}"
    assert cap.trace is stepped_analysis.summary and cap.cpu_only and cap.gpus == []
    again = loads(dumps(cap))
    assert again.trace == cap.trace
    d = diagnose(again)
    assert d.target == cap.target  # a verdict (likely inconclusive: no GPU) rather than an error


def test_steps_without_profiler_annotations_come_from_gemm_runs(trace_dir: Path) -> None:
    path = w.profile_generation(trace_dir / "plain.json", batch=3, prompt=12, decode_steps=4, profiler_steps=False)
    a = analyze_trace(path)
    assert a.ops is not None and a.ops.total_flops == w.expected_flops(3, 12, 4)
    ph = a.phases
    assert ph is not None and ph.source == "GEMM runs"
    assert "ProfilerStep" not in a.window_policy
    assert ph.steps[0].phase == "prefill" and ph.steps[0].tokens == 36
    assert a.summary.decode_batch == 3


def test_gzip_and_plain_give_the_same_analysis(stepped: Path, stepped_analysis: TraceAnalysis,
                                               tmp_path: Path) -> None:
    gz = tmp_path / "stepped.json.gz"
    gz.write_bytes(gzip.compress(stepped.read_bytes()))
    again = analyze_trace(gz)
    assert again.ops is not None and stepped_analysis.ops is not None
    assert again.ops.total_flops == stepped_analysis.ops.total_flops
    assert again.summary.decode_batch == stepped_analysis.summary.decode_batch
    assert again.summary.intensity_flop_per_byte == stepped_analysis.summary.intensity_flop_per_byte


def test_folder_of_ranks_is_combined(stepped: Path, tmp_path: Path) -> None:
    for rank in (0, 1):
        data = json.loads(stepped.read_text())
        data["distributedInfo"] = {"rank": rank, "world_size": 2}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(data))
    a = analyze_trace(tmp_path)
    assert [r.rank for r in a.ranks] == [0, 1]
    assert a.summary.decode_batch == BATCH
    assert a.summary.rank_count == 2
    assert a.world_size == 2


def test_trace_without_shapes_says_flops_are_not_derived(trace_dir: Path) -> None:
    path = w.profile_generation(trace_dir / "noshapes.json", decode_steps=2, record_shapes=False)
    a = analyze_trace(path)
    assert a.ops is None and a.phases is None
    assert any("record_shapes" in note for note in a.summary.skipped)


def test_a_copy_in_a_directory_with_other_files_is_found(stepped: Path, tmp_path: Path) -> None:
    shutil.copy(stepped, tmp_path / "only.pt.trace.json")
    (tmp_path / "notes.txt").write_text("not a trace")
    a = analyze_trace(tmp_path)
    assert len(a.ranks) == 1


def test_ridge_point_is_read_at_the_precision_the_ops_ran_at(stepped_analysis: TraceAnalysis) -> None:
    from diagnoser import physics
    from diagnoser.evidence_build import build_evidence

    cap = capture_from_trace(stepped_analysis, gpu_name="H100")
    assert cap.trace is not None and cap.trace.dtype == "fp32"
    ridge = build_evidence(cap)["theory.ridge_flop_per_byte"].values[0]
    assert ridge == physics.ridge_point(physics.get_gpu("H100"), "fp32")
    assert ridge < physics.ridge_point(physics.get_gpu("H100"), "bf16")
