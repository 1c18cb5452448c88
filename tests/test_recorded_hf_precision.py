"""The precision fix applied on a real GPU and re-measured (tests/fixtures/gpu/hf/precision): transformers'
compiled `generate` at batch 1 on an H200, the 2.4b Llama in FP32, then the same in bf16, one process after the
other. Written before the recording (scripts/gpu/EXPECTED.md): FP32 110-140 tokens/s, the realised gain x1.4-1.9,
the fix offered "serve in 16-bit" bounded by the bytes it saves, not by the FP32 -> BF16 tensor rate (x15)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

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


def test_the_recording_ran_as_the_physics_said() -> None:
    fp32, bf16 = _calls_rate("hf-static-compile-b1-fp32"), _calls_rate("hf-static-compile-b1-bf16")
    assert 110 <= fp32 <= 140
    assert 1.4 <= bf16 / fp32 <= 1.9


def test_an_fp32_model_is_told_to_serve_in_16_bit_first_sized_by_its_bytes() -> None:
    d = diagnose(load(FP32))
    kinds = [f.kind for f in d.fixes]
    assert FixKind.MIXED_PRECISION in kinds
    # Before FP8: the 16-bit model halves every kernel's bytes, FP8 weights only the weights'.
    assert kinds.index(FixKind.MIXED_PRECISION) < kinds.index(FixKind.FP8_WEIGHTS)
    fix = next(f for f in d.fixes if f.kind is FixKind.MIXED_PRECISION)
    assert "bf16" in fix.action and fix.gain is not None
    realised = _calls_rate("hf-static-compile-b1-bf16") / _calls_rate("hf-static-compile-b1-fp32")
    assert fix.gain_kind is GainKind.ESTIMATE and abs(fix.gain / realised - 1) <= 0.25, (fix.gain, fix.basis)
    # The trace's FP32 GEMVs (cuBLAS names its types only in template arguments) are found.
    assert "CMP003" in [f.code for f in d.findings]


def test_compare_grades_the_16_bit_model_against_its_promise() -> None:
    c = compare(diagnose_capture(load(FP32)), diagnose_capture(load(BF16)))
    changed = {ch.what: ch for ch in c.changes}
    assert changed["model.dtype"].fix is FixKind.MIXED_PRECISION
    (p,) = [p for p in c.predictions if p.kind is FixKind.MIXED_PRECISION]
    assert p.applied and p.verdict == "held", (p, c.confounders)
    (fp8,) = [p for p in c.predictions if p.kind is FixKind.FP8_WEIGHTS]
    assert not fp8.applied  # bf16 is not an FP8 checkpoint


def test_the_fp32_trace_window_reads_its_gemvs_as_fp32_matmuls() -> None:
    from diagnoser.characterise import fp32_share
    from diagnoser.traces.analysis import analyze_trace

    trace = analyze_trace(PRECISION / "hf-static-compile-b1-fp32-50ms.json.gz").summary
    gemv = sum(k.share for k in trace.top_kernels if "gemv" in k.full_name)
    assert gemv > 0.3  # the decode's matmuls at batch 1 (written from the kernel list before the code)
    assert fp32_share(trace) >= gemv - 1e-9
