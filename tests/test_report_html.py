"""The HTML report as a document: self-contained, in reading order, the right charts for each verdict, numbers that
match the evidence, untrusted strings escaped and secrets redacted. (test_report_browser.py opens them for real.)"""

from __future__ import annotations

import base64
import hashlib
import html as htmllib
import re
from pathlib import Path

import pytest
from markupsafe import escape

from diagnoser import physics
from diagnoser.capture import Series
from diagnoser.errors import InputError
from diagnoser.evidence_build import build_evidence
from diagnoser.fleet.model import FleetReport
from diagnoser.rules import diagnose
from diagnoser.units import fmt
from tests.test_report_cases import (
    KERNEL,
    LIMITERS,
    SECRETS,
    XSS_IMG,
    XSS_SCRIPT,
    XSS_SVG,
    case_capture,
    case_diagnosis,
    fleet_report,
    hostile_capture,
    render_fleet_html,
    render_html,
    write_fleet_html,
    write_html,
)

# The charts each verdict's report must draw, the first being the one about the verdict.
EXPECTED_CHARTS = {
    "memory_bandwidth": ("roofline", "activity", "throughput", "timeline", "memory", "kv", "server", "power"),
    "compute": ("roofline", "activity", "kernels", "timeline"),
    "vram": ("kv", "memory", "server", "throughput"),
    "batching": ("server", "timeline", "activity", "throughput"),
    "host_launch": ("timeline", "host", "activity", "kernels", "roofline"),
    "throttling": ("clocks", "power", "activity"),
    "interconnect": ("kernels", "timeline", "activity"),
    "idle": ("timeline", "activity", "server", "power"),
    "errors": ("activity", "timeline"),
    "inconclusive": (),
}


def _render(limiter: str) -> str:
    capture, d = case_diagnosis(limiter)
    return render_html(d, capture)


def _charts(page: str) -> list[str]:
    return re.findall(r'<figure class="card" id="fig-[^"]+" data-chart="([^"]+)"', page)


def _figure(page: str, key: str) -> str:
    start = page.index(f'data-chart="{key}"')
    return page[start: page.index("</figure>", start)]


def _drawing(page: str, key: str, variant: str = "wide") -> str:
    """One drawing of a figure: each chart comes drawn for a column ("wide") and for a phone ("narrow")."""
    fig = _figure(page, key)
    start = fig.index(f'class="chart {variant}"')
    return fig[start: fig.index("</svg>", start)]


def _csp_hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


@pytest.mark.parametrize("limiter", LIMITERS)
def test_report_is_self_contained(limiter: str) -> None:
    page = _render(limiter)
    assert page.startswith("<!doctype html>")
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?\s*(?:https?:|//|file:)""", page, re.I)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert "<iframe" not in page and "<img" not in page and "<object" not in page
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page, re.S)
    styles = re.findall(r"<style>(.*?)</style>", page, re.S)
    assert len(scripts) == 1 and scripts[0][0] == "" and len(styles) == 1
    # The CSP allows exactly this stylesheet and this script, and nothing from the network.
    csp = htmllib.unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1))
    assert "default-src 'none'" in csp
    assert f"'{_csp_hash(styles[0])}'" in csp and f"'{_csp_hash(scripts[0][1])}'" in csp
    assert ' style="' not in page  # inline style attributes would be blocked by the CSP


@pytest.mark.parametrize("limiter", LIMITERS)
def test_sections_in_reading_order_and_charts_for_the_verdict(limiter: str) -> None:
    capture, d = case_diagnosis(limiter)
    page = render_html(d, capture)
    order = [page.index(f'id="{s}"') for s in ("verdict", "fixes", "pictures", "evidence", "missing", "context",
                                                 "signals")]
    assert order == sorted(order)
    charts = _charts(page)
    expected = EXPECTED_CHARTS[limiter]
    assert set(expected) <= set(charts), charts
    if expected:
        assert charts[0] == expected[0]
    assert f'data-verdict="{limiter}"' in page
    for fix in d.fixes[:3]:
        assert str(escape(fix.title)) in page[page.index('id="fixes"'):page.index('id="pictures"')]
    evidence = page[page.index('id="evidence"'):page.index('id="missing"')]
    for finding in d.findings:
        assert f'id="finding-{finding.code}"' in evidence
        for c in finding.citations:
            assert str(escape(fmt(c.value, c.unit))) in evidence


def test_inconclusive_report_leads_with_what_to_collect() -> None:
    capture, d = case_diagnosis("inconclusive")
    page = render_html(d, capture)
    assert "To reach a verdict, collect" in page
    assert "not in the physics table" in page
    for want in d.to_collect:
        assert str(escape(want)) in page


def test_numbers_in_charts_match_the_evidence() -> None:
    capture, d = case_diagnosis("memory_bandwidth")
    ev = build_evidence(capture)
    page = render_html(d, capture, ev)
    gpu = ev.gpu_spec
    tensor, dram = ev["gpu.tensor_active"].mean, ev["gpu.dram_active"].mean
    intensity = tensor * gpu.flops["bf16"] / (dram * gpu.hbm_bytes_per_s)
    roofline = _figure(page, "roofline")
    flops = tensor * gpu.flops["bf16"]
    attainable = min(gpu.flops["bf16"], gpu.hbm_bytes_per_s * intensity)
    # The counters' ratio is drawn hollow: with the model known, the physics of the decode step is the trusted point.
    assert (f"counters (est.): {intensity:,.1f} FLOP/B, {fmt(flops, 'FLOP/s')}, {flops / attainable:.0%} of its roof; "
            "not representative" in roofline)
    physics_point = f"decode at batch {fmt(ev.observed_batch())} (physics): {ev['theory.intensity'].value:,.1f} FLOP/B"
    assert physics_point in roofline and "The filled point (decode at batch" in roofline
    assert f"ridge {fmt(physics.ridge_point(gpu, 'bf16'), 'FLOP/B')}" in roofline
    throughput = _figure(page, "throughput")
    assert f"achieved: {ev['server.gen_tokens_per_s'].mean:,.0f} tokens/s" in throughput
    ceiling = ev["theory.decode_ceiling_tokens_per_s"].values[0]
    assert f"{ceiling:,.0f} tokens/s" in throughput
    assert f"{ev['theory.efficiency'].values[0]:.0%} of the ceiling" in throughput
    activity = _figure(page, "activity")
    assert "BW001: DRAM active mean \u2265 60 %" in activity  # the rule's threshold, drawn on its signal
    timeline = _figure(page, "timeline")
    assert f"busy  {fmt(ev['gpu.busy'].mean, 'ratio')}" in timeline


def test_trace_time_share_and_kernel_classes() -> None:
    capture, d = case_diagnosis("host_launch")
    page = render_html(d, capture)
    timeline = _figure(page, "timeline")
    assert "busy in the trace  55 %" in timeline and "idle: host launch gaps  30 %" in timeline
    assert "idle: host syncs  10 %" in timeline and "idle: not attributed  5.0 %" in timeline
    kernels = _figure(page, "kernels")
    assert "GEMM (matmul)" in kernels and "50 %" in kernels and "12,000 kernels" in kernels


def test_throttle_bands_and_power_limit() -> None:
    capture, d = case_diagnosis("throttling")
    page = render_html(d, capture)
    for variant in ("wide", "narrow"):
        clocks = _drawing(page, "clocks", variant)
        assert clocks.count("<rect") == 1 and "power cap: 20-60 s" in clocks  # throttled from 20 s to the end
    power = _figure(page, "power")
    assert "power limit 500 W" in power and "board default 700 W" in power  # a lowered cap, and the default


def test_untrusted_strings_are_escaped() -> None:
    capture = hostile_capture()
    page = render_html(diagnose(capture), capture)
    assert page.count("<script") == 1  # ours
    for raw in ('<img src=x onerror="window.__xss=2">', "<svg onload", "</text></svg><svg", "<script>window"):
        assert raw not in page
    for payload in (XSS_SCRIPT, XSS_IMG, XSS_SVG):
        assert str(escape(payload)) in page  # shown as text
    assert str(escape(KERNEL)) in page  # in the trace's "not read" list, brackets and all
    assert XSS_SVG not in page and KERNEL not in page  # the raw markup never appears


def test_secrets_never_appear() -> None:
    capture = hostile_capture()
    page = render_html(diagnose(capture), capture)
    for secret in SECRETS.values():
        assert secret not in page
    assert "--api-key [redacted]" in page
    assert "http://[redacted]@10.0.0.5:8000/metrics" in page


def test_long_series_are_downsampled_for_drawing() -> None:
    capture = case_capture("memory_bandwidth")
    n = 20_000
    capture.series.append(Series(name="gpu.sm_occupancy", unit="ratio", source="gpm",
                                 times=[i * 0.01 for i in range(n)], values=[(i % 100) / 100 for i in range(n)]))
    for s in capture.series_named("gpu.dram_active"):
        s.times = [i * 0.01 for i in range(n)]
        s.values = [0.7 + 0.1 * ((i * 7919) % 13) / 13 for i in range(n)]
    d = diagnose(capture)
    page = render_html(d, capture)
    activity = _figure(page, "activity")
    longest = max(len(p.split(" L")) for p in re.findall(r' d="M([^"]+)"', activity))
    assert longest <= 700
    assert len(page) < 600_000


def test_unknown_gpu_and_no_model_degrade_to_notes() -> None:
    capture = case_capture("batching")
    capture.gpus[0].name = "Mystery Accelerator 9000"
    capture.model = None
    page = render_html(diagnose(capture), capture)
    assert "roofs are unknown" in page and "the model&#39;s shape" in page
    assert "roofline" not in _charts(page)


def test_write_is_atomic_and_errors_are_one_sentence(tmp_path: Path) -> None:
    capture, d = case_diagnosis("compute")
    out = write_html(d, capture, tmp_path / "sub" / "report.html")
    assert out.read_text().startswith("<!doctype html>")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["report.html"]  # no temp file left behind
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError, match="cannot write the report to"):
        write_html(d, capture, blocker / "report.html")


def test_fleet_report_sorted_by_money_with_totals(tmp_path: Path) -> None:
    report = fleet_report()
    page = render_fleet_html(report)
    table = page[page.index('id="fleet-table"'):]
    body = table[table.index("<tbody>"):table.index("</tbody>")]
    stakes = [float(v) for v in re.findall(r'data-v="([0-9.]+)">\$', body)]
    assert stakes == sorted(stakes, reverse=True) and len(stakes) == len(report.rows)
    total = sum(r.usd_per_hour_at_stake for r in report.rows)
    assert f"${total:,.2f}/h" in page and f"${total * 730:,.0f}" in page
    assert "table data-sortable" in page and page.count('class="card gpu-detail"') == len(report.rows)
    assert "dcgm-exporter scrape timed out" in page and "partial" in page
    assert 'data-chart="verdicts"' in page
    written = write_fleet_html(report, tmp_path / "fleet.html").read_text()
    assert written.count("<tr>") == page.count("<tr>")


def test_fleet_escapes_and_redacts() -> None:
    page = render_fleet_html(fleet_report(hostile=True))
    assert page.count("<script") == 1 and "<img" not in page
    assert SECRETS["pass"] not in page and "[redacted]@prometheus" in page
    assert str(escape(XSS_SCRIPT)) in page


def test_empty_and_unpriced_fleet() -> None:
    page = render_fleet_html(FleetReport(source="http://prometheus:9090", window_start=0.0, window_end=600.0))
    assert "0 GPUs" in page and "No GPU reported" in page and "not priced" in page


def test_fleet_priced_per_row_from_the_list_price_table() -> None:
    report = fleet_report()
    report.usd_per_gpu_hour = None  # prices came per GPU model, not from --usd-per-gpu-hour
    report.rows[-1].usd_per_gpu_hour = None
    report.rows[-1].usd_per_hour_at_stake = 0.0
    page = render_fleet_html(report)
    total = sum(r.usd_per_hour_at_stake for r in report.rows)
    assert f"${total:,.2f}/h" in page and "rough cloud list prices" in page and "1 GPU without a price" in page
    assert "&ndash;</td>" in page and "not priced" not in page


# --- one number for one quantity: real H100 recordings ----------------------------------------------------------

GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"


@pytest.fixture(scope="module")
def recorded() -> dict[str, tuple[object, str]]:
    """Outcomes of H100 recordings with their HTML pages: decode at a running batch of 509 with a trace whose own
    shapes say 1.3 (kv-full), and a host-bound decode whose 2 s trace saw the GPU busy 30 % of an 8 s window that
    NVML saw it busy 39 % (host-bound)."""
    from diagnoser.capture import load
    from diagnoser.pipeline import diagnose_capture
    from diagnoser.reports.html import HtmlRenderer

    out = {}
    for name in ("kv-full", "host-bound"):
        outcome = diagnose_capture(load(GPU / f"nvidia-h100-80gb-hbm3-{name}.dgc"))
        out[name] = (outcome, HtmlRenderer().render(outcome.report()))
    return out


def _text(html: str) -> str:
    """What a reader sees: tags gone, entities read, runs of space as one."""
    return re.sub(r"\s+", " ", htmllib.unescape(re.sub(r"<[^>]+>", " ", html)))


def _card(page: str, heading: str) -> str:
    start = page.index(f"<h3>{heading}</h3>")
    return page[start: page.index("</dl>", start)]


def test_the_observed_batch_reads_the_same_everywhere(recorded) -> None:  # type: ignore[no-untyped-def]
    outcome, page = recorded["kv-full"]
    ev = outcome.evidence
    batch, ridge_batch = fmt(ev.observed_batch()), fmt(ev["theory.ridge_batch"].values[0])
    assert batch == "509" and ridge_batch == "262"
    text = _text(page)
    # The regime sentence, the roofline's point and the throughput marks write the one batch and the one ridge batch
    # with one formatter (the regime sentence once wrote "batch 509.0").
    assert f"(batch {batch} against a ridge batch of {ridge_batch})" in text
    assert f"decode at batch {batch} (physics)" in _text(_figure(page, "roofline"))
    marks = _text(_figure(page, "throughput"))
    assert f"batch {batch} (observed)" in marks and f"batch {ridge_batch} (ridge)" in marks
    assert not re.search(r"batch \d+\.0\b", text)
    # The trace's own decode batch is another quantity (what the traced steps' shapes show), and is labelled so.
    trace = _text(_card(page, "Trace"))
    assert f"decode batch (from the trace) {fmt(outcome.capture.trace.decode_batch)}" in trace
    assert not re.search(r"decode batch \d", trace)


def test_ridges_are_rounded_and_say_which_roofs(recorded) -> None:  # type: ignore[no-untyped-def]
    outcome, page = recorded["kv-full"]
    ev, trace = outcome.evidence, outcome.capture.trace
    ridge = fmt(ev["theory.ridge_flop_per_byte"].values[0], "FLOP/B")
    assert f"ridge {ridge}" in _text(_figure(page, "roofline"))
    # The trace analysis held its ops against the datasheet's ridge, not the measured roofs' one: labelled, and
    # rounded like every other (it was printed "ridge_flop_per_byte 295.343").
    card = _text(_card(page, "Trace"))
    assert f"ridge (datasheet roofs) {fmt(trace.ridge_flop_per_byte, 'FLOP/B')}" in card
    assert fmt(trace.ridge_flop_per_byte, "FLOP/B") != ridge
    assert not re.search(r"\d\.\d{3}", card) and "_" not in card.replace(trace.path, "")


def test_busy_shares_of_two_windows_are_labelled(recorded) -> None:  # type: ignore[no-untyped-def]
    outcome, page = recorded["host-bound"]
    trace_busy, counter_busy = outcome.capture.trace.gpu_busy_frac, outcome.evidence["gpu.busy"].mean
    assert fmt(trace_busy, "ratio") == "30 %" and fmt(counter_busy, "ratio") == "39 %"
    timeline = _figure(page, "timeline")
    # The chart reads the trace's share, says so, and names the counter's share of the whole window beside it.
    assert f"busy in the trace  {fmt(trace_busy, 'ratio')}" in timeline
    assert f"gpu.busy from NVML reads {fmt(counter_busy, 'ratio')}" in _text(timeline)
    assert "30.2%" not in timeline


def test_every_trace_result_has_a_label_and_unit() -> None:
    """The trace card names each typed trace result; a new field without a row here would print its bare name."""
    from diagnoser.capture import TRACE_RESULTS
    from diagnoser.reports.model import TRACE_RESULT_LABELS

    assert set(TRACE_RESULTS) == set(TRACE_RESULT_LABELS)
