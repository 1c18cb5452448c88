"""Reports opened in a real headless Chromium: for every verdict and for a fleet, the page renders its key text and
charts with real size, logs no console error, loads nothing but itself, and nothing in a hostile capture runs.

Needs Debian's chromium (scripts/install-test-deps.sh) and the playwright pip package (the `test` extra), which
drives /usr/bin/chromium; `playwright install` is never needed. Screenshots go to a temporary folder, or to
$DIAGNOSER_SCREENSHOTS when set, for a person to look at.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from diagnoser.reports.model import verdict_label
from diagnoser.rules import diagnose
from tests.test_report_cases import (
    LIMITERS,
    SECRETS,
    XSS_IMG,
    XSS_SCRIPT,
    case_capture,
    case_diagnosis,
    fleet_report,
    hostile_capture,
    render_fleet_html,
    render_html,
    write_fleet_html,
    write_html,
)
from tests.test_report_html import EXPECTED_CHARTS

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright (pip, test extra) is not installed")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium: run scripts/install-test-deps.sh"),
]

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
TIMEOUT_MS = 60_000  # a loaded two-core machine


@dataclass
class Visit:
    page: Any
    url: str
    console: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=TIMEOUT_MS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wanted = os.environ.get("DIAGNOSER_SCREENSHOTS")
    path = Path(wanted) if wanted else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def visit(browser: Any, path: Path, *, javascript: bool = True) -> Visit:
    context = browser.new_context(viewport={"width": 1366, "height": 900}, java_script_enabled=javascript)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    v = Visit(page, path.resolve().as_uri())
    page.on("console", lambda m: v.console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: v.errors.append(str(e)))
    page.on("request", lambda r: v.requests.append(r.url))
    page.on("dialog", lambda d: (v.dialogs.append(d.message), d.dismiss()))
    page.goto(v.url, wait_until="load")
    return v


def assert_clean(v: Visit) -> None:
    assert not v.errors, v.errors
    assert not [c for c in v.console if c.startswith(("error", "warning"))], v.console
    assert v.requests == [v.url], v.requests  # only the file itself
    assert not v.dialogs


def chart_boxes(page: Any) -> dict[str, dict[str, float]]:
    """Each figure's shown drawing (a figure carries one per width; exactly one is displayed)."""
    boxes = {}
    for fig in page.locator("figure[data-chart]").all():
        shown = fig.locator("svg.chart:visible")
        assert shown.count() == 1, fig.get_attribute("data-chart")
        boxes[fig.get_attribute("data-chart")] = shown.bounding_box()
    return boxes


@pytest.mark.parametrize("limiter", LIMITERS)
def test_report_renders_for_each_verdict(browser: Any, shots: Path, tmp_path: Path, limiter: str) -> None:
    capture, d = case_diagnosis(limiter)
    path = write_html(d, capture, tmp_path / f"{limiter}.html")
    v = visit(browser, path)
    try:
        page = v.page
        shot = shots / f"report-{limiter}.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 20_000
        label = verdict_label(d)
        assert page.locator(".verdict-name").inner_text().lower() == label.lower()
        assert page.locator(".hero .pill").inner_text().startswith(d.confidence_label)
        assert page.locator(".hero .headline").is_visible()
        text = page.locator("body").inner_text()
        for fix in d.fixes[:3]:
            assert fix.title in text
        boxes = chart_boxes(page)
        assert set(EXPECTED_CHARTS[limiter]) <= set(boxes)
        for key, box in boxes.items():
            assert box is not None and box["width"] > 300 and box["height"] > 60, (key, box)
        for f in d.findings:
            assert page.locator(f"#finding-{f.code}").is_visible()
        assert_clean(v)
    finally:
        v.page.context.close()


def test_charts_render_without_javascript(browser: Any, tmp_path: Path) -> None:
    capture, d = case_diagnosis("host_launch")
    v = visit(browser, write_html(d, capture, tmp_path / "nojs.html"), javascript=False)
    try:
        boxes = chart_boxes(v.page)
        assert set(EXPECTED_CHARTS["host_launch"]) <= set(boxes)
        assert all(b["width"] > 300 and b["height"] > 60 for b in boxes.values())
        assert_clean(v)
    finally:
        v.page.context.close()


def test_report_prints(browser: Any, shots: Path, tmp_path: Path) -> None:
    capture, d = case_diagnosis("memory_bandwidth")
    v = visit(browser, write_html(d, capture, tmp_path / "print.html"))
    try:
        v.page.emulate_media(media="print")
        assert v.page.locator(".topbar nav").is_hidden()
        pdf = v.page.pdf(format="A4", print_background=True)
        assert pdf.startswith(b"%PDF") and len(pdf) > 30_000
        (shots / "report-memory_bandwidth.pdf").write_bytes(pdf)
        assert_clean(v)
    finally:
        v.page.context.close()


def test_fleet_report_renders_and_sorts(browser: Any, shots: Path, tmp_path: Path) -> None:
    report = fleet_report()
    v = visit(browser, write_fleet_html(report, tmp_path / "fleet.html"))
    try:
        page = v.page
        page.screenshot(path=str(shots / "fleet.png"), full_page=True)
        assert page.locator(".fleet-title").inner_text().startswith(f"{len(report.rows)} GPUs")
        box = page.locator("#fig-verdicts svg.chart:visible").bounding_box()
        assert box is not None and box["width"] > 600 and box["height"] > 60
        rows = page.locator("#fleet-table tbody tr")
        assert rows.count() == len(report.rows)

        def column(index: int) -> list[str]:
            return [rows.nth(i).locator("td").nth(index).get_attribute("data-v") or "" for i in range(rows.count())]

        stakes = [float(x) for x in column(5)]
        assert stakes == sorted(stakes, reverse=True)  # server order, without any script
        assert page.locator("#sort-note").inner_text().startswith("Sorted by money at stake")
        header = page.locator("#fleet-table th[title=confidence]")
        header.locator("button").click()
        first = [float(x) for x in column(3)]
        assert first == sorted(first, reverse=True)
        header.locator("button").click()
        second = [float(x) for x in column(3)]
        assert second == sorted(second)
        assert header.get_attribute("aria-sort") == "ascending"
        # The sentence over the table (printed with it) follows the order the rows are in.
        assert page.locator("#sort-note").inner_text() == "Sorted by confidence, lowest first."
        assert_clean(v)
    finally:
        v.page.context.close()


@pytest.mark.parametrize("kind", ["report", "fleet"])
def test_hostile_strings_do_not_execute(browser: Any, shots: Path, tmp_path: Path, kind: str) -> None:
    if kind == "report":
        capture = hostile_capture()
        html = render_html(diagnose(capture), capture)
    else:
        html = render_fleet_html(fleet_report(hostile=True))
    path = tmp_path / f"hostile-{kind}.html"
    path.write_text(html)
    v = visit(browser, path)
    try:
        page = v.page
        page.screenshot(path=str(shots / f"hostile-{kind}.png"), full_page=True)
        assert page.evaluate("typeof window.__xss") == "undefined"
        assert page.locator("img").count() == 0
        assert page.evaluate("document.scripts.length") == 1
        assert page.evaluate("document.querySelectorAll('[onerror],[onload]').length") == 0
        text = page.locator("body").inner_text()
        assert XSS_SCRIPT in text  # shown literally
        assert XSS_IMG.strip() in text or "onerror=" in text
        for secret in SECRETS.values():
            assert secret not in page.content()
        assert_clean(v)
    finally:
        v.page.context.close()


# --- every page at a phone's, a tablet's and a laptop's width, and on paper ------------------------------------

WIDTHS = (390, 768, 1280)
A4_CSS_PX = 703  # 210 mm less the 12 mm margins on each side, at 96 px per inch
GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"
_TRACES = Path(__file__).resolve().parent / "fixtures" / "traces"
H100 = ("decode-b1", "decode-b16", "decode-fp8", "prefill", "kv-full", "host-bound", "launch", "demo")
TRACES = {"trace-h100-decode-b1": GPU / "traces" / "h100-decode-b1-30ms.json.gz",
          "trace-h100-launch": GPU / "traces" / "h100-launch-30ms.json.gz",
          "trace-recsys-2-ranks": _TRACES / "recsys-sampled-2of128",
          "trace-mi300x-ddp": _TRACES / "mi300x-ddp8-resnet-train-rank0-step16.json.gz"}

# What does not fit: the page wider than the window, any element whose content is wider than its box (a table
# leaving its card, a scroller), chart text drawn under 9 px, a chart label running out of its drawing.
LAYOUT_JS = """() => {
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  const name = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
    (typeof el.className === 'string' && el.className ? '.' + el.className.trim().split(/\\s+/).join('.') : '');
  const out = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > doc.clientWidth) out.push(`page ${doc.scrollWidth} > ${doc.clientWidth}`);
  for (const el of document.body.querySelectorAll('*')) {
    if (el.closest('svg')) continue;
    if (el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1)
      out.push(`${name(el)} ${el.scrollWidth} > ${el.clientWidth}`);
  }
  for (const svg of document.querySelectorAll('svg.chart')) {
    const box = svg.getBoundingClientRect();
    if (box.width === 0) continue;
    const where = name(svg.closest('figure') || svg);
    const card = (svg.closest('figure') || svg.parentElement).getBoundingClientRect();
    if (box.right > card.right + 1 || box.left < card.left - 1) out.push(`${where}: chart outside its card`);
    const view = svg.viewBox.baseVal;
    const scale = box.width / view.width;
    for (const t of svg.querySelectorAll('text')) {
      const size = parseFloat(getComputedStyle(t).fontSize) * scale;
      if (size < 9) out.push(`${where}: text "${t.textContent}" drawn at ${size.toFixed(1)} px`);
      if (t.hasAttribute('transform') || t.closest('[transform]') !== t && t.closest('g[transform]')) continue;
      const b = t.getBBox();
      if (b.x < -1 || b.x + b.width > view.width + 1)
        out.push(`${where}: "${t.textContent}" runs out of the drawing ` +
                 `(${b.x.toFixed(0)}..${(b.x + b.width).toFixed(0)} of ${view.width})`);
    }
    // Labels that name marks, points and thresholds on the plot never sit on one another.
    const labels = [...svg.querySelectorAll('text.marknum, text.pt, text.lane, text.tick, text.ref')]
      .filter(t => !t.hasAttribute('transform')).map(t => [t.textContent, t.getBBox()]);
    for (let i = 0; i < labels.length; i++) for (let j = i + 1; j < labels.length; j++) {
      const [ta, a] = labels[i], [tb, b] = labels[j];
      if (a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height)
        out.push(`${where}: "${ta}" overlaps "${tb}"`);
    }
  }
  return out;
}"""


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every kind of page: a report per verdict, a hostile one, real H100 recordings, a fleet and a comparison."""
    from diagnoser.capture import load
    from diagnoser.compare import compare
    from diagnoser.pipeline import diagnose_capture
    from diagnoser.reports import html
    from diagnoser.reports.compare import write_html as write_compare_html
    from diagnoser.traces.analysis import analyze_trace, capture_from_trace

    folder = tmp_path_factory.mktemp("pages")
    out = {}
    for limiter in LIMITERS:
        capture, d = case_diagnosis(limiter)
        out[limiter] = write_html(d, capture, folder / f"{limiter}.html")
    hostile = hostile_capture()
    out["hostile"] = write_html(diagnose(hostile), hostile, folder / "hostile.html")
    # Names with no place to break (a trace path, a model id) wrap inside their box at any width, whatever the fonts.
    long_names = case_capture("memory_bandwidth")
    long_names.target = "trace " + "/".join(["checkouts", "x" * 40, "tests", "fixtures", "gpu", "traces"]) + "/b1.json.gz"
    assert long_names.model is not None
    long_names.model.name = "org-" + "Meta-Llama-3.1-405B-Instruct-FP8-dynamic-" * 2
    out["long-names"] = write_html(diagnose(long_names), long_names, folder / "long-names.html")
    # Every H100 recording: their roofline points sit at batch 1 to 509, their thresholds close together.
    recorded = {name: diagnose_capture(load(GPU / f"nvidia-h100-80gb-hbm3-{name}.dgc")) for name in H100}
    for name, outcome in recorded.items():
        out[f"h100-{name}"] = html.write_html(outcome.report(), folder / f"h100-{name}.html")
    # Real traces through `analyze`'s path: H100 decode windows without and with recorded shapes, a two-rank job
    # with a straggler, an eight-rank ROCm training step.
    # Each from a deep folder: captions and facts quote the trace's path, which is as long as the checkout's (a CI
    # checkout one folder deeper than this one overflowed a 390 px screen by 2 px).
    deep = folder.joinpath(*(["a_checkout_folder_with_a_long_name"] * 3))
    deep.mkdir(parents=True)
    for name, trace in TRACES.items():
        copy = deep / trace.name
        (shutil.copytree if trace.is_dir() else shutil.copyfile)(trace, copy)
        outcome = diagnose_capture(capture_from_trace(analyze_trace(copy, jobs=1)))
        out[name] = html.write_html(outcome.report(), folder / f"{name}.html")
    out["fleet"] = write_fleet_html(fleet_report(), folder / "fleet.html")
    for after in ("decode-fp8", "decode-b16"):  # batch 16 predicts x15: a bar across most of the axis
        out[f"compare-{after}"] = write_compare_html(compare(recorded["decode-b1"], recorded[after]),
                                                     folder / f"compare-{after}.html")
    return out


@pytest.mark.parametrize("width", WIDTHS)
def test_every_page_fits_the_screen(browser: Any, shots: Path, pages: dict[str, Path], width: int) -> None:
    context = browser.new_context(viewport={"width": width, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        problems = {}
        for name, path in pages.items():
            page.goto(path.resolve().as_uri(), wait_until="load")
            found = page.evaluate(LAYOUT_JS)
            if found:
                problems[name] = found[:8]
            page.screenshot(path=str(shots / f"{name}-{width}.png"), full_page=True)
            for fig in page.locator("figure[data-chart]").all():
                assert fig.locator("svg.chart:visible").count() == 1, (name, fig.get_attribute("data-chart"))
        assert not problems, problems
        assert not errors, errors
    finally:
        context.close()


def test_pages_fit_when_the_fonts_run_wider(browser: Any, pages: dict[str, Path]) -> None:
    """Another machine's fonts are a little wider: a page that fits here only by a few pixels fails there (a trace
    path in the facts row did, by 2 px). Spacing the letters out by 0.06 em stands in for the wider font. The charts
    keep their spacing: their labels are laid out from an average glyph width (reports/svg.py), not the page's flow."""
    context = browser.new_context(viewport={"width": 390, "height": 900}, bypass_csp=True)
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        problems = {}
        for name, path in pages.items():
            page.goto(path.resolve().as_uri(), wait_until="load")
            page.add_style_tag(content="body * { letter-spacing: 0.06em; } svg, svg * { letter-spacing: normal; }")
            if found := page.evaluate(LAYOUT_JS):
                problems[name] = found[:8]
        assert not problems, problems
    finally:
        context.close()


@contextmanager
def _printed(browser: Any, path: Path) -> Iterator[Any]:
    """The page at A4 width with the print stylesheet applied."""
    context = browser.new_context(viewport={"width": A4_CSS_PX, "height": 1000})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(path.resolve().as_uri(), wait_until="load")
        page.emulate_media(media="print")
        yield page
    finally:
        context.close()


@pytest.mark.parametrize("name", ["fleet", "memory_bandwidth", "h100-decode-b1", "h100-kv-full"])
def test_print_keeps_every_column(browser: Any, shots: Path, pages: dict[str, Path], name: str) -> None:
    with _printed(browser, pages[name]) as page:
        assert page.evaluate(LAYOUT_JS) == []
        # Every column of every table is on the paper, inside its card: none cut off, none scrolled out of view.
        cut = page.evaluate("""() => {
          const out = [];
          for (const table of document.querySelectorAll('table')) {
            const card = (table.closest('.card') || table.parentElement).getBoundingClientRect();
            for (const cell of table.querySelectorAll('th, td')) {
              const r = cell.getBoundingClientRect();
              if (r.width < 8 || r.right > card.right + 1)
                out.push(`${cell.textContent.trim().slice(0, 40)}: ${r.width.toFixed(0)} px wide, ` +
                         `right ${r.right.toFixed(0)} > ${card.right.toFixed(0)}`);
            }
          }
          return out;
        }""")
        assert cut == [], cut[:10]
        pdf = page.pdf(format="A4", print_background=True)
        assert pdf.startswith(b"%PDF")
        (shots / f"{name}-print.pdf").write_bytes(pdf)
        page.screenshot(path=str(shots / f"{name}-print.png"), full_page=True)


def test_crowded_marks_and_labels_do_not_overlap(browser: Any, shots: Path, tmp_path: Path) -> None:
    """Ceilings a few per cent apart (a batch of 1.2 beside batch 1, a ridge near the observed batch) keep labels
    apart, at both drawing widths."""
    from diagnoser.reports.figdata import Bullet, Mark
    from diagnoser.reports.html import HtmlRenderer
    from tests.test_report_cases import report_of

    capture, d = case_diagnosis("memory_bandwidth")
    report = report_of(d, capture)
    fig = next(f for f in report.figures if f.key == "throughput")
    marks = [Mark(f"ceiling {i}", v, key=f"k{i}", short=f"batch {b} (label {i})", color="#E69F00")
             for i, (v, b) in enumerate([(1000.0, 1), (1040.0, 1.2), (1100.0, 2), (1180.0, 3), (9000.0, 256)])]
    fig.spec = Bullet(fig.title, 900.0, marks)
    path = tmp_path / "crowded.html"
    path.write_text(HtmlRenderer().render(report))
    for width in (390, 1280):
        context = browser.new_context(viewport={"width": width, "height": 900})
        try:
            page = context.new_page()
            page.goto(path.resolve().as_uri(), wait_until="load")
            assert page.evaluate(LAYOUT_JS) == []
            page.locator("#fig-throughput").screenshot(path=str(shots / f"crowded-marks-{width}.png"))
            assert page.locator("#fig-throughput svg.chart:visible text.marknum").count() == len(marks)
        finally:
            context.close()


# --- issue-sized checks: each names the chart and the measure --------------------------------------------------

# The boxes of a drawing's texts of some classes, in its own units, with the drawing's width.
TEXT_BOXES_JS = """([figure, classes]) => {
  const svg = [...document.querySelectorAll(`#${figure} svg.chart`)].find(s => s.getBoundingClientRect().width > 0);
  const view = svg.viewBox.baseVal;
  return [view.width, [...svg.querySelectorAll(classes)].map(t => {
    const b = t.getBBox();
    return {text: t.lastChild.textContent, x0: b.x, x1: b.x + b.width, y0: b.y, y1: b.y + b.height};
  })];
}"""


def _text_boxes(page: Any, figure: str, classes: str) -> tuple[float, list[dict[str, Any]]]:
    width, boxes = page.evaluate(TEXT_BOXES_JS, [figure, classes])
    return width, boxes


def _overlaps(boxes: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(a["text"], b["text"]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
            if a["x0"] < b["x1"] and b["x0"] < a["x1"] and a["y0"] < b["y1"] and b["y0"] < a["y1"]]


@pytest.mark.parametrize("width", WIDTHS)
def test_roofline_names_stay_inside_the_chart(browser: Any, pages: dict[str, Path], width: int) -> None:
    """A point at batch 509 sits near the right of the plot: its name ("decode at batch 509 (physics)") went 76 px
    out of the drawing's left edge at 390 px. Every point's name lies inside the drawing and clear of the roofs'
    labels and of the other names."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        for name in ("h100-kv-full", "h100-decode-b16", "h100-demo", "h100-launch"):
            page.goto(pages[name].resolve().as_uri(), wait_until="load")
            view, names = _text_boxes(page, "fig-roofline", "text.pt")
            assert names, name
            outside = [n["text"] for n in names if n["x0"] < 0 or n["x1"] > view]
            assert not outside, (name, width, outside)
            _, labels = _text_boxes(page, "fig-roofline", "text.pt, text.ref:not([transform]), text.tick")
            assert not _overlaps(labels), (name, width, _overlaps(labels))
    finally:
        context.close()


@pytest.mark.parametrize("media", ["390", "768", "1280", "print"])
def test_compare_values_read_in_full(browser: Any, pages: dict[str, Path], media: str) -> None:
    """Batch 1 -> 16 predicts about x15: the bar spans most of the axis, and its value written left of the bar ran out of
    the drawing, so the page showed "d x15.0" (as it then read) at every width and on paper. Each value lies inside its drawing."""
    width = A4_CSS_PX if media == "print" else int(media)
    context = browser.new_context(viewport={"width": width, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        if media == "print":
            page.emulate_media(media="print")
        page.goto(pages["compare-decode-b16"].resolve().as_uri(), wait_until="load")
        view, values = _text_boxes(page, "fig-gains", "text.value")
        assert sorted(v["text"].split(" ")[0] for v in values) == ["predicted", "realised"]
        assert [v["text"] for v in values if v["x0"] < 0 or v["x1"] > view] == []
        assert not _overlaps(values)
    finally:
        context.close()


@pytest.mark.parametrize("width", [390, 1280])
def test_threshold_labels_do_not_overlap(browser: Any, pages: dict[str, Path], width: int) -> None:
    """LAT001 draws four thresholds on the activity chart, two at the same 60 % (DRAM and tensor pipes) and the others
    at 70 and 80 %: their labels were drawn on top of one another."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(pages["h100-decode-b1"].resolve().as_uri(), wait_until="load")
        view, refs = _text_boxes(page, "fig-activity", "text.ref")
        assert sum(r["text"].startswith("LAT001") for r in refs) == 4
        assert _overlaps(refs) == []
        _, with_ticks = _text_boxes(page, "fig-activity", "text.ref, text.tick")
        assert _overlaps(with_ticks) == []
        assert all(r["x0"] >= 0 and r["x1"] <= view for r in refs)
    finally:
        context.close()


A4_CONTENT_PX = (297 - 2 * 14) * 96 / 25.4  # the page's height less its margins (report.css @page)

# Words cut across two lines although the whitespace-separated run holding them fits the cell's width.
BROKEN_WORDS_JS = """() => {
  const out = [];
  for (const cell of document.querySelectorAll('td, th, dd, dt')) {
    const style = getComputedStyle(cell);
    const room = cell.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const run of node.textContent.matchAll(/\\S+/g)) {
        const whole = document.createRange();
        whole.setStart(node, run.index); whole.setEnd(node, run.index + run[0].length);
        const width = [...whole.getClientRects()].reduce((sum, r) => sum + r.width, 0);
        if (width > room) continue;  // wider than the column: it has to break somewhere
        for (const word of run[0].matchAll(/[\\p{L}\\p{N}]{2,}/gu)) {
          const range = document.createRange();
          range.setStart(node, run.index + word.index); range.setEnd(node, run.index + word.index + word[0].length);
          const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
          if (lines.size > 1) out.push(`${cell.tagName.toLowerCase()}: "${word[0]}" of "${run[0]}"`);
        }
      }
    }
  }
  return out;
}"""


@pytest.mark.parametrize("name", ["h100-kv-full", "h100-decode-b1", "memory_bandwidth"])
def test_print_fills_its_pages_and_keeps_words_whole(browser: Any, shots: Path, pages: dict[str, Path],
                                                    name: str) -> None:
    """On paper a long card kept whole jumped to the next page and left the one before half empty (kv-full printed
    19 pages for 14.7 pages of content), and table columns shrank until a rule code broke mid-word ("VRAM0|01")."""
    with _printed(browser, pages[name]) as page:
        page.evaluate("document.querySelectorAll('details').forEach(d => { d.open = true; })")
        assert page.evaluate(BROKEN_WORDS_JS) == []
        # Nothing wider than the paper: Chromium would shrink every page to fit it, and the count below with it.
        assert page.evaluate("document.documentElement.scrollWidth") <= A4_CSS_PX
        content = page.evaluate("document.documentElement.scrollHeight") / A4_CONTENT_PX
        pdf = page.pdf(format="A4", print_background=True)
        (shots / f"{name}-pages.pdf").write_bytes(pdf)
        counts = [int(n) for n in re.findall(rb"/Count\s+(\d+)", pdf)]
        assert counts, "no page tree in the PDF"
        # What breaks fall between small blocks costs part of a page each; a half-empty page costs about one.
        assert max(counts) <= math.ceil(content) + 1, (max(counts), round(content, 2))
