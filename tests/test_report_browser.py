"""Reports opened in a real headless Chromium: for every verdict and for a fleet, the page renders its key text and
charts with real size, logs no console error, loads nothing but itself, and nothing in a hostile capture runs.

Needs Debian's chromium (scripts/install-test-deps.sh) and the playwright pip package (the `test` extra), which
drives /usr/bin/chromium; `playwright install` is never needed. Screenshots go to a temporary folder, or to
$DIAGNOSER_SCREENSHOTS when set, for a person to look at.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
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
    boxes = {}
    for fig in page.locator("figure[data-chart]").all():
        box = fig.locator("svg.chart").bounding_box()
        boxes[fig.get_attribute("data-chart")] = box
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
        box = page.locator("#fig-verdicts svg.chart").bounding_box()
        assert box is not None and box["width"] > 600 and box["height"] > 60
        rows = page.locator("#fleet-table tbody tr")
        assert rows.count() == len(report.rows)

        def column(index: int) -> list[str]:
            return [rows.nth(i).locator("td").nth(index).get_attribute("data-v") or "" for i in range(rows.count())]

        stakes = [float(x) for x in column(6)]
        assert stakes == sorted(stakes, reverse=True)  # server order, without any script
        header = page.locator("#fleet-table th", has_text="confidence")
        header.locator("button").click()
        first = [float(x) for x in column(4)]
        assert first == sorted(first, reverse=True)
        header.locator("button").click()
        second = [float(x) for x in column(4)]
        assert second == sorted(second)
        assert header.get_attribute("aria-sort") == "ascending"
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
