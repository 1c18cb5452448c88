"""The trace views of the report, on real traces: H100 decode windows recorded without and with input shapes, a
two-rank recommendation job with a straggler, and captures recorded before the trace analysis named its kernels.
Each view's numbers are checked against the trace summary they come from; Chromium draws them in
test_report_browser.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markupsafe import escape

from diagnoser.capture import HostCall, KernelStat, TimelineGap, TimelineItem, TimelineWindow, load
from diagnoser.evidence_build import build_evidence
from diagnoser.pipeline import diagnose_capture
from diagnoser.reports import svg
from diagnoser.reports.figdata import (
    Bars,
    Bullet,
    Figure,
    Histogram,
    KernelTable,
    Lane,
    Lanes,
    NotDrawn,
    Span,
    StackedRows,
)
from diagnoser.reports.figures import build_figures, throughput_marks
from diagnoser.reports.html import HtmlRenderer
from diagnoser.reports.trace_figures import KERNEL_STYLE, kernel_table
from diagnoser.traces.analysis import analyze_trace, capture_from_trace
from tests.test_report_cases import XSS_IMG, XSS_SCRIPT, XSS_SVG, case_capture

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GPU = FIXTURES / "gpu"


def _outcome(path: Path):  # type: ignore[no-untyped-def]
    return diagnose_capture(capture_from_trace(analyze_trace(path, jobs=1)))


@pytest.fixture(scope="module")
def launch():  # type: ignore[no-untyped-def]
    """Recorded with input shapes: its GEMMs are costed."""
    return _outcome(GPU / "traces" / "h100-launch-30ms.json.gz")


@pytest.fixture(scope="module")
def decode():  # type: ignore[no-untyped-def]
    """Recorded without shapes: no kernel has FLOPs or bytes."""
    return _outcome(GPU / "traces" / "h100-decode-b1-30ms.json.gz")


@pytest.fixture(scope="module")
def two_ranks():  # type: ignore[no-untyped-def]
    return _outcome(FIXTURES / "traces" / "recsys-sampled-2of128")


def _figure(report, key: str) -> Figure:  # type: ignore[no-untyped-def]
    return next(f for f in report.figures if f.key == key)


def _chart(page: str, key: str, variant: str = "wide") -> str:
    fig = page[page.index(f'data-chart="{key}"'):]
    fig = fig[:fig.index("</figure>")]
    start = fig.index(f'class="chart {variant}"')
    return fig[start:fig.index("</svg>", start)]


def test_kernel_table_with_shapes_has_speed_of_light(launch) -> None:  # type: ignore[no-untyped-def]
    report = launch.report()
    trace, gpu = launch.capture.trace, launch.evidence.gpu_spec
    table = report.kernels
    assert isinstance(table, KernelTable) and gpu is not None
    assert [r.name for r in table.rows] == [k.name for k in trace.top_kernels]
    assert table.shown_share == pytest.approx(sum(k.share for k in trace.top_kernels))
    costed = [(r, k) for r, k in zip(table.rows, trace.top_kernels, strict=False) if k.costed_calls]
    assert costed, "the launch trace was recorded with shapes"
    peak = gpu.flops[trace.dtype]  # bf16 on the H100
    for row, k in costed:
        flop, byte = k.achieved_flop_per_s / peak, k.achieved_bytes_per_s / gpu.hbm_bytes_per_s
        assert row.sol == pytest.approx(max(flop, byte))
        assert ("HBM" in row.sol_roof) == (byte >= flop)
        assert row.achieved and not row.why_no_sol
    for row, k in zip(table.rows, trace.top_kernels, strict=False):
        if not k.costed_calls:
            assert row.sol is None and row.why_no_sol == "needs its op's shapes"
        assert row.color == KERNEL_STYLE[k.kind][1]
    page = HtmlRenderer().render(report)
    section = page[page.index('id="kernels"'):page.index('id="evidence"')]
    assert section.count("<tr data-kind") == len(table.rows)
    assert 'aria-label="speed of light"' in section and "of HBM" in section


def test_views_without_shapes_still_drawn(decode) -> None:  # type: ignore[no-untyped-def]
    report = decode.report()
    trace = decode.capture.trace
    assert isinstance(report.kernels, KernelTable)
    assert all(r.sol is None for r in report.kernels.rows)
    assert "none of these kernels has them" in report.kernels.caption
    window = _figure(report, "trace-window")
    assert isinstance(window.spec, Lanes) and window.wide
    labels = [lane.label for lane in window.spec.lanes]
    streams = sorted({i.stream for i in trace.timeline.items})
    assert labels == ["host"] + [f"stream {s}" for s in streams] + ["GPU idle"]
    assert sum(len(lane.spans) for lane in window.spec.lanes if lane.label.startswith("stream")) == len(
        trace.timeline.items)
    assert "ui.perfetto.dev" in window.caption and trace.path in window.caption
    hist = _figure(report, "durations").spec
    assert isinstance(hist, Histogram)
    assert sum(hist.counts) == pytest.approx(1.0) and sum(hist.times) == pytest.approx(1.0)
    assert dict(hist.markers)["p50"] == trace.kernel_duration_us.p50_us
    assert len(hist.edges_us) == len(hist.counts) + 1
    page = HtmlRenderer().render(report)
    # The page-wide window comes at three widths; the others at two.
    fig = page[page.index('data-chart="trace-window"'):]
    fig = fig[:fig.index("</figure>")]
    assert all(f'class="chart {v}"' in fig for v in ("full", "wide", "narrow"))
    assert 'class="card wide"' in page[page.rindex("<figure", 0, page.index('data-chart="trace-window"')):]
    assert "ranks" not in [f.key for f in report.figures]  # one rank: nothing to compare
    assert len(page) < 300_000  # 1,314 ops drawn three times, merged below a pixel


def test_ranks_side_by_side_mark_the_straggler(two_ranks) -> None:  # type: ignore[no-untyped-def]
    report = two_ranks.report()
    trace = two_ranks.capture.trace
    assert len(trace.ranks) == 2 and trace.straggler
    fig = _figure(report, "ranks")
    assert isinstance(fig.spec, StackedRows)
    flagged = [row.label for row in fig.spec.rows if row.flag == "straggler"]
    assert flagged == [f"rank {r.rank}" for r in trace.ranks if r.straggler]
    for row, rank in zip(fig.spec.rows, sorted(trace.ranks, key=lambda r: r.rank), strict=True):
        assert sum(s.value for s in row.segments) == pytest.approx(1.0, abs=0.002)
        assert row.segments[0].value == pytest.approx(rank.compute_frac)
        assert row.segments[1].value == pytest.approx(rank.comm_exposed_frac)
    assert trace.straggler[1:30] in fig.caption
    # Communication split by collective in the kernel-class chart, as the trace measured it.
    kernels = _figure(report, "kernels").spec
    assert isinstance(kernels, Bars)
    items = dict(kernels.items)
    for kind, share in trace.comm_share_by_kind.items():
        if share > 0:
            label = {"all_to_all": "NCCL all-to-all", "all_gather": "NCCL all-gather",
                     "all_reduce": "NCCL all-reduce"}.get(kind)
            if label:
                assert items[label] == pytest.approx(share)
    assert "communication (NCCL)" not in items
    assert "rank 0" in _figure(report, "trace-window").caption  # the window is the first rank's
    page = HtmlRenderer().render(report)
    assert "straggler" in _chart(page, "ranks") and "straggler" in _chart(page, "ranks", "narrow")


def test_captures_from_before_the_fields_degrade_to_a_reason() -> None:
    outcome = diagnose_capture(load(GPU / "nvidia-h100-80gb-hbm3-decode-b1.dgc"))
    assert outcome.capture.trace is not None and not outcome.capture.trace.top_kernels
    report = outcome.report()
    assert report.kernels is None
    why = {n.title: n.why for n in report.not_drawn}
    assert "a trace analysed by this version" in why["Top kernels by GPU time"]
    assert "a trace analysed by this version" in why["A window of the trace: streams, kernels and gaps"]
    assert "a trace analysed by this version" in why["How long kernels run"]
    page = HtmlRenderer().render(report)
    assert 'id="kernels"' not in page and "Top kernels by GPU time" in page


def test_no_trace_no_trace_views() -> None:
    capture = case_capture("memory_bandwidth")
    ev = build_evidence(capture)
    _, missing = build_figures(capture, ev, diagnose_capture(capture).diagnosis)
    assert not [n for n in missing if n.title.startswith(("A window", "How long", "Ranks"))]
    assert isinstance(kernel_table(capture, ev), NotDrawn)


def test_kernel_and_timeline_names_are_escaped() -> None:
    capture = _outcome(GPU / "traces" / "h100-decode-b1-30ms.json.gz").capture
    trace = capture.trace
    assert trace is not None
    trace.top_kernels = [KernelStat(name=XSS_SCRIPT, full_name=XSS_SVG, kind="gemm", count=3, total_us=30.0,
                                    share=0.5, mean_us=10.0, p50_us=10.0, p90_us=11.0)]
    trace.timeline = TimelineWindow(label=XSS_IMG, length_us=100.0, names=[XSS_SVG],
                                    items=[TimelineItem(device=0, stream=7, start_us=1.0, dur_us=5.0, kind="gemm",
                                                        name=0)],
                                    gaps=[TimelineGap(device=0, start_us=6.0, dur_us=3.0, cause="host")],
                                    host_calls=[HostCall(tid=1, start_us=0.0, dur_us=1.0, kind="launch")])
    page = HtmlRenderer().render(diagnose_capture(capture).report())
    assert page.count("<script") == 1 and "<svg onload" not in page
    page = page.replace("<wbr>", "")  # the kernel name may wrap after its separators: the only markup added to it
    assert str(escape(XSS_SCRIPT)) in page and str(escape(XSS_IMG)) in page
    assert str(escape(XSS_SVG)) in page  # the full name, under its short one, and in the lane's tooltip


def test_ops_under_a_pixel_are_merged_with_what_they_hold() -> None:
    spans = [Span(i * 2.0, 1.5, "#0072B2", f"k{i % 3}", "GEMM") for i in range(2500)]
    spans.append(Span(6000.0, 500.0, "#B2182B", "ncclKernel_AllReduce", "communication (NCCL)"))
    drawn = svg.lanes_chart("t", [Lane("stream 7", spans)], 7000.0, [("GEMM", "#0072B2")], width=svg.NARROW)
    rects = re.findall(r"<rect [^>]*fill=\"#(?:0072B2|B2182B)\"", drawn)
    plot_px = svg.NARROW  # at most a span every 4 px, and the collective on its own
    assert 2 <= len(rects) <= plot_px / 4 + 2, len(rects)
    assert re.search(r"\d+ ops in [\d.]+ µs from [\d.]+ (µs|ms): k\d 3\d%, k\d 3\d%, \.\.\.", drawn)
    assert "ncclKernel_AllReduce (communication (NCCL)): 500 µs" in drawn
    assert 'fill="#B2182B"' in drawn


def test_throughput_marks_keep_their_key_and_colour_across_reports() -> None:
    b16 = diagnose_capture(load(GPU / "nvidia-h100-80gb-hbm3-decode-b16.dgc"))
    case = case_capture("memory_bandwidth")
    seen: dict[str, str] = {}
    for capture, ev in ((b16.capture, b16.evidence), (case, build_evidence(case))):
        marks = throughput_marks(capture, ev)
        assert [m.key for m in marks] == ["batch1", "observed", "ridge"]
        for m in marks:
            assert seen.setdefault(m.key, m.color) == m.color
        assert [m.value for m in marks] == sorted(m.value for m in marks)
    # A batch-1 decode: the ceiling for one sequence is the observed batch's; one mark says both.
    b1 = diagnose_capture(load(GPU / "nvidia-h100-80gb-hbm3-decode-b1.dgc"))
    marks = throughput_marks(b1.capture, b1.evidence)
    assert [m.key for m in marks] == ["batch1", "ridge"] and marks[0].short == "batch 1 (observed)"
    fig = _figure(b1.report(), "throughput")
    assert isinstance(fig.spec, Bullet) and "batch 1 (observed)" in fig.caption
    page = HtmlRenderer().render(b1.report())
    for variant in ("wide", "narrow"):
        chart = _chart(page, "throughput", variant)
        assert 'data-mark="batch1"' in chart and 'data-mark="ridge"' in chart and 'data-mark="observed"' not in chart


def test_terminal_lists_the_top_kernels(launch) -> None:  # type: ignore[no-untyped-def]
    import io

    from diagnoser.reports.terminal import TOP_KERNELS, TerminalRenderer

    out = io.StringIO()
    TerminalRenderer(file=out, color=False).render(launch.report())
    text = out.getvalue()
    section = text[text.index("Top kernels by GPU time"):]
    kernels = launch.capture.trace.top_kernels
    assert kernels[0].name in section and f"{kernels[0].share:.1%}" in section
    assert "speed of light" in section and f"{len(kernels) - TOP_KERNELS} more with --verbose" in section
    assert max(len(line) for line in text.splitlines()) <= 80


def test_rocm_collectives_are_rccl() -> None:
    outcome = _outcome(FIXTURES / "traces" / "mi300x-ddp8-resnet-train-rank0-step16.json.gz")
    assert outcome.capture.trace is not None and outcome.capture.trace.platform == "rocm"
    report = outcome.report()
    labels = [label for label, _ in _figure(report, "kernels").spec.items]  # type: ignore[union-attr]
    assert any(label.startswith("RCCL") for label in labels) and not any("NCCL" in label for label in labels)
    window = _figure(report, "trace-window").spec
    assert isinstance(window, Lanes)
    assert ("communication (RCCL)", KERNEL_STYLE["comm"][1]) in window.legend
