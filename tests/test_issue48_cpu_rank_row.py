"""Issue 48: a vLLM CPU trace's rank row says "n/a" for idle, as for busy: a CPU-only trace has no GPU timeline, so
its idle share is not measured, not 0 %."""

from __future__ import annotations

import shutil
from pathlib import Path

from diagnoser.reports.trace_text import render_analysis
from diagnoser.traces import analyze_trace

TRACES = Path(__file__).resolve().parent / "fixtures" / "traces"


def test_a_cpu_only_rank_reads_not_measured_idle_beside_not_measured_busy(tmp_path: Path) -> None:
    for name in ("vllm-cpu-0.32-tiny-llama-250ms.json.gz", "vllm-cpu-0.32-frontend.async_llm.pt.trace.json.gz"):
        shutil.copy(TRACES / name, tmp_path / name)
    lines = render_analysis(analyze_trace(tmp_path, jobs=1))
    row = lines[lines.index(next(ln for ln in lines if ln.startswith("Ranks:"))) + 1]
    assert row.split()[:2] == ["rank", "0"], row
    assert row.split()[2:7] == ["n/a"] * 5, row
    assert "0.0%" not in row
