"""The precision fix applied on a real GPU and re-measured (tests/fixtures/gpu/hf/precision): transformers'
compiled `generate` on an H200, the 2.4b Llama in FP32, then the same in bf16, one process after the other, at batch
1 and at batch 16. Written before the recording (scripts/gpu/EXPECTED.md): at batch 1 FP32 110-140 tokens/s and
x1.4-1.9 realised (both held); at batch 16 FP32 1,400-2,000 tokens/s and x1.6-1.95 (both wrong: 677 tokens/s and
x3.09, the FP32 SIMT GEMMs and FP32 attention far less efficient than the bf16 kernels). So the promise is the bound
the physics gives (the GPU's work at the bf16 floor, the host's time kept), not the kept-efficiency estimate, and
not the FP32 -> BF16 tensor rate (x15)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from diagnoser.capture import load
from diagnoser.compare import compare
from diagnoser.diagnosis import FixKind, GainKind
from diagnoser.pipeline import diagnose_capture
from diagnoser.rules import diagnose

PRECISION = Path(__file__).parent / "fixtures" / "gpu" / "hf" / "precision"
FP32, BF16 = PRECISION / "hf-static-compile-b1-fp32.dgc", PRECISION / "hf-static-compile-b1-bf16.dgc"


def _calls_rate(name: str) -> float:
    """The workload's own tokens/s: the median of its full calls after the warm-up (its stats file)."""
    calls = json.loads((PRECISION / f"{name}.stats.json").read_text())["call_log"][1:]
    return statistics.median(c["tokens_per_s"] for c in calls)


def test_the_batch_1_recording_ran_as_the_physics_said() -> None:
    fp32, bf16 = _calls_rate("hf-static-compile-b1-fp32"), _calls_rate("hf-static-compile-b1-bf16")
    assert 110 <= fp32 <= 140
    assert 1.4 <= bf16 / fp32 <= 1.9


def _window_rate(path: Path) -> float:
    series = load(path).series_named("server.gen_tokens_per_s")
    return statistics.fmean(series[0].values)


@pytest.mark.parametrize("batch", [1, 16])
def test_an_fp32_model_is_told_to_serve_in_16_bit_bounded_by_the_16_bit_floor(batch: int) -> None:
    fp32, bf16 = PRECISION / f"hf-static-compile-b{batch}-fp32.dgc", PRECISION / f"hf-static-compile-b{batch}-bf16.dgc"
    d = diagnose(load(fp32))
    fix = next(f for f in d.fixes if f.kind is FixKind.MIXED_PRECISION)
    realised = _window_rate(bf16) / _window_rate(fp32)
    assert fix.gain_kind is GainKind.UPPER_BOUND and fix.gain is not None
    assert realised <= fix.gain <= 2 * realised, (fix.gain, realised, fix.basis)
    assert "keep their efficiency" in fix.basis  # the estimate is given, as no promise
    c = compare(diagnose_capture(load(fp32)), diagnose_capture(load(bf16)))
    (p,) = [p for p in c.predictions if p.kind is FixKind.MIXED_PRECISION]
    assert p.applied and p.verdict == "within the bound", (p, c.confounders)


def test_an_fp32_model_is_told_to_serve_in_16_bit_first_sized_by_its_bytes() -> None:
    d = diagnose(load(FP32))
    kinds = [f.kind for f in d.fixes]
    assert FixKind.MIXED_PRECISION in kinds
    # Before FP8: the 16-bit model halves every kernel's bytes, FP8 weights only the weights'.
    assert kinds.index(FixKind.MIXED_PRECISION) < kinds.index(FixKind.FP8_WEIGHTS)
    fix = next(f for f in d.fixes if f.kind is FixKind.MIXED_PRECISION)
    assert "bf16" in fix.action and fix.gain is not None
    # The trace's FP32 GEMVs (cuBLAS names its types only in template arguments) are found.
    assert "CMP003" in [f.code for f in d.findings]


def test_compare_grades_the_16_bit_model_against_its_promise() -> None:
    c = compare(diagnose_capture(load(FP32)), diagnose_capture(load(BF16)))
    changed = {ch.what: ch for ch in c.changes}
    assert changed["model.dtype"].fix is FixKind.MIXED_PRECISION
    (p,) = [p for p in c.predictions if p.kind is FixKind.MIXED_PRECISION]
    assert p.applied and p.graded, (p, c.confounders)
    (fp8,) = [p for p in c.predictions if p.kind is FixKind.FP8_WEIGHTS]
    assert not fp8.applied  # bf16 is not an FP8 checkpoint


def test_the_fp32_trace_window_reads_its_gemvs_as_fp32_matmuls() -> None:
    from diagnoser.characterise import fp32_share
    from diagnoser.traces.analysis import analyze_trace

    trace = analyze_trace(PRECISION / "hf-static-compile-b1-fp32-50ms.json.gz").summary
    gemv = sum(k.share for k in trace.top_kernels if "gemv" in k.full_name)
    assert gemv > 0.3  # the decode's matmuls at batch 1 (written from the kernel list before the code)
    assert fp32_share(trace) >= gemv - 1e-9
