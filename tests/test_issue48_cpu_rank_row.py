"""Issue 48, a vLLM CPU trace: every number right, not all said. Its rank row says "n/a" for idle, as for busy (a
CPU-only trace has no GPU timeline, so its idle share is not measured, not 0 %); the window outside the engine's
steps (36 % of this one) is said, split by the same CPU op classes, so sampling, which vLLM runs after the annotated
forward, is named where it runs rather than lost."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from diagnoser.evidence_build import build_evidence
from diagnoser.reports.html import HtmlRenderer
from diagnoser.reports.model import build_report
from diagnoser.reports.trace_text import render_analysis
from diagnoser.rules import diagnose
from diagnoser.traces import analyze_trace, capture_from_trace
from diagnoser.traces.engine_steps import CPU_OP_CLASS

TRACES = Path(__file__).resolve().parent / "fixtures" / "traces"


def test_a_cpu_only_rank_reads_not_measured_idle_beside_not_measured_busy(tmp_path: Path) -> None:
    for name in ("vllm-cpu-0.32-tiny-llama-250ms.json.gz", "vllm-cpu-0.32-frontend.async_llm.pt.trace.json.gz"):
        shutil.copy(TRACES / name, tmp_path / name)
    lines = render_analysis(analyze_trace(tmp_path, jobs=1))
    row = lines[lines.index(next(ln for ln in lines if ln.startswith("Ranks:"))) + 1]
    assert row.split()[:2] == ["rank", "0"], row
    assert row.split()[2:7] == ["n/a"] * 5, row
    assert "0.0%" not in row


RANK = TRACES / "vllm-cpu-0.32-tiny-llama-250ms.json.gz"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def test_the_window_outside_the_steps_is_split_by_op_class() -> None:
    a = analyze_trace(RANK, jobs=1)
    e = a.summary.engine_steps
    assert e is not None
    outside = e.outside_op_share
    # they add up to the window outside the steps (64.2 % inside in this window)
    assert sum(outside.values()) == pytest.approx(1.0 - e.steps_frac)
    with gzip.open(RANK) as f:
        raw = json.loads(f.read())["traceEvents"]
    steps = _union([(ev["ts"], ev["ts"] + ev["dur"]) for ev in raw if ev.get("cat") == "user_annotation"
                    and ev["name"].startswith("execute_context_")])
    w0, w1 = a.window
    gaps, at = [], w0
    for x, y in steps:
        if x > at:
            gaps.append((at, x))
        at = max(at, y)
    gaps.append((at, w1))
    for cls in ("matmul", "sampling"):
        ops = _union([(ev["ts"], ev["ts"] + ev["dur"]) for ev in raw
                      if ev.get("cat") == "cpu_op" and CPU_OP_CLASS.get(ev["name"]) == cls])
        held = sum(max(0.0, min(b, d) - max(x, c)) for x, b in ops for c, d in gaps)
        assert outside.get(cls, 0.0) == pytest.approx(held / (w1 - w0), abs=1e-9), cls
    assert outside.get("sampling", 0.0) > 0


def test_analyze_and_the_report_say_the_window_outside_the_steps() -> None:
    a = analyze_trace(RANK, jobs=1)
    text = "\n".join(render_analysis(a))
    assert "outside the steps, 35.8% of the window: " in text and "sampling" in text
    capture = capture_from_trace(a)
    ev = build_evidence(capture)
    report = build_report(capture, ev, diagnose(capture))
    assert "outside the steps (35.8% of the window)" in HtmlRenderer().render(report)


def test_the_report_draws_the_window_by_the_engines_steps() -> None:
    from diagnoser.reports.figdata import StackedRows
    from diagnoser.reports.figures import build_figures

    capture = capture_from_trace(analyze_trace(RANK, jobs=1))
    ev = build_evidence(capture)
    figures, _ = build_figures(capture, ev, diagnose(capture))
    fig = next(f for f in figures if f.key == "engine-steps")
    assert isinstance(fig.spec, StackedRows)
    (row,) = fig.spec.rows
    assert sum(s.value for s in row.segments) == pytest.approx(1.0)
    labels = {s.label for s in row.segments}
    assert "in steps: matmul" in labels and "between steps: sampling" in labels
