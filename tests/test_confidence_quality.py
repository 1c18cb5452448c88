"""Confidence follows the data's quality: a cut-short, sampled or tiny trace never reads "high" (issue: a truncated
trace flipped its verdict and kept "high (0.90)")."""

from __future__ import annotations

import gzip
from pathlib import Path

from diagnoser.rules import diagnose
from diagnoser.traces import analyze_trace, capture_from_trace

TRACES = Path(__file__).resolve().parent / "fixtures" / "gpu" / "traces"


def _diagnose(path: Path):  # type: ignore[no-untyped-def]
    return diagnose(capture_from_trace(analyze_trace(path)))


def test_a_cut_short_trace_lowers_the_confidence_and_says_why(tmp_path: Path) -> None:
    whole = TRACES / "h100-launch-30ms.json.gz"
    raw = gzip.decompress(whole.read_bytes())
    cut = tmp_path / "cut.json"
    cut.write_bytes(raw[: len(raw) * 2 // 3])  # the file ends mid-event, as a killed profiler leaves it
    full, part = _diagnose(whole), _diagnose(cut)
    assert any("cut short" in r for r in part.confidence_reasons), part.confidence_reasons
    assert part.confidence <= 0.6 * full.confidence + 1e-9
    assert part.confidence_label != "high"


def test_a_one_kernel_toy_and_a_tiny_window_are_never_high(tmp_path: Path) -> None:
    traces = Path(__file__).resolve().parent / "fixtures" / "traces"
    for path in (traces / "a100_torch_compile_triton.json.gz", traces / "mi250-rocm-toy-train.json.gz"):
        d = _diagnose(path)
        assert d.confidence_label == "low", (path.name, d.confidence, d.confidence_reasons)
        assert any("kernel" in r and ("only" in r or "too few" in r) for r in d.confidence_reasons)


def test_a_sampled_multi_rank_trace_says_its_shares_are_estimates() -> None:
    sampled = Path(__file__).resolve().parent / "fixtures" / "traces" / "recsys-sampled-2of128"
    d = _diagnose(sampled)
    assert any("sampled" in r and "estimates" in r for r in d.confidence_reasons)
    assert d.confidence_label != "high"
