"""The report contract: terminal.py and html.py render a Report and nothing past it. The model builds every view
and redacts every string once; a renderer shows what the Report says, reads no diagnosis, and does not redact call
by call (a renderer that must remember to redact is one that can forget)."""

from __future__ import annotations

import ast
import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest

from diagnoser.capture import HostCall, KernelStat, TimelineGap, TimelineItem, TimelineWindow
from diagnoser.evidence_build import build_evidence
from diagnoser.reports.figdata import Lanes
from diagnoser.reports.html import HtmlRenderer
from diagnoser.reports.jsonout import JsonRenderer, dumps
from diagnoser.reports.model import FleetView, Report, build_fleet_view, build_report, report_from_diagnosis
from diagnoser.reports.terminal import TerminalRenderer
from diagnoser.rules import diagnose
from tests.test_report_cases import SECRETS, XSS_SCRIPT, case_capture, fleet_report, hostile_capture

REPORTS = Path(__file__).resolve().parents[1] / "diagnoser" / "reports"
RENDERERS = ("terminal.py", "html.py")
DRAWERS = (*RENDERERS, "svg.py")  # what draws a Report's figures: it redacts nothing either
# What a renderer may take from diagnoser.diagnosis: enums for labels and the schema's version, no diagnosis types.
ALLOWED_FROM_DIAGNOSIS = {"Verdict", "Limiter", "Regime", "Benefit", "GainKind", "FixKind", "SCHEMA_VERSION"}


def _tree(name: str) -> ast.Module:
    return ast.parse((REPORTS / name).read_text(), filename=name)


@pytest.mark.parametrize("name", RENDERERS)
def test_renderers_do_not_reach_past_the_report(name: str) -> None:
    reached = sorted({f"line {n.lineno}: .{n.attr}" for n in ast.walk(_tree(name))
                      if isinstance(n, ast.Attribute) and n.attr in ("diagnosis", "document")})
    assert not reached, f"{name} reads past the Report: {reached}"


@pytest.mark.parametrize("name", RENDERERS)
def test_renderers_import_no_diagnosis_types(name: str) -> None:
    imported: set[str] = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.ImportFrom) and node.module in ("diagnoser.diagnosis", "diagnoser.capture",
                                                                 "diagnoser.evidence"):
            imported |= {a.name for a in node.names}
            assert node.module == "diagnoser.diagnosis", f"{name} imports {node.module}"
    assert imported <= ALLOWED_FROM_DIAGNOSIS, f"{name} imports {sorted(imported - ALLOWED_FROM_DIAGNOSIS)}"


@pytest.mark.parametrize("name", DRAWERS)
def test_renderers_leave_redaction_to_the_model(name: str) -> None:
    """No renderer imports or calls a redaction function: the model redacted every view, figures included."""
    tree = _tree(name)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                if a.name.startswith("redact") or (n.module or "").endswith(".redact")}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                 if a.name.endswith(".redact")}
    called = {f"line {n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Call)
              and (n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")).startswith("redact")}
    assert not imported and not called, f"{name} redacts: imports {sorted(imported)}, calls at {sorted(called)}"


def _strings(obj: Any, path: str = "report") -> list[tuple[str, str]]:
    """Every string a Report or a FleetView holds for a renderer, figures included, with where it sits (the JSON
    document excepted: jsonout redacts the document whole)."""
    if isinstance(obj, str):
        return [(path, obj)]
    if isinstance(obj, Report):
        return [s for f in dataclasses.fields(obj) if f.name != "document"
                for s in _strings(getattr(obj, f.name), f"{path}.{f.name}")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [s for f in dataclasses.fields(obj) for s in _strings(getattr(obj, f.name), f"{path}.{f.name}")]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in _strings(k, path) + _strings(v, f"{path}[{k!r}]")]
    if isinstance(obj, (list, tuple)):
        return [s for i, v in enumerate(obj) for s in _strings(v, f"{path}[{i}]")]
    return []


@pytest.fixture(scope="module")
def hostile() -> Report:
    capture = hostile_capture()
    assert capture.trace is not None  # a timeline window and kernels whose names carry secrets: figure labels
    capture.trace.top_kernels = [KernelStat(name=f"gemm --api-key {SECRETS['sk']}", full_name=f"HF_TOKEN={SECRETS['hf']}",
                                            kind="gemm", count=3, total_us=30.0, share=0.5, mean_us=10.0, p50_us=10.0,
                                            p90_us=11.0)]
    capture.trace.timeline = TimelineWindow(
        label=f"https://admin:{SECRETS['pass']}@h/x", length_us=100.0, names=[f"op token={SECRETS['sk']}"],
        items=[TimelineItem(device=0, stream=7, start_us=1.0, dur_us=5.0, kind="gemm", name=0)],
        gaps=[TimelineGap(device=0, start_us=6.0, dur_us=3.0, cause="host")],
        host_calls=[HostCall(tid=1, start_us=0.0, dur_us=1.0, kind="launch")])
    ev = build_evidence(capture)
    return build_report(capture, ev, diagnose(capture))


def test_every_string_of_the_report_is_redacted(hostile: Report) -> None:
    strings = _strings(hostile)
    assert any(XSS_SCRIPT in text for _, text in strings)  # the capture's strings are there, markup and all
    leaks = [(where, secret) for where, text in strings for secret in SECRETS.values() if secret in text]
    assert not leaks


def test_figures_come_redacted_from_the_model(hostile: Report) -> None:
    """A figure's labels and tooltips are redacted when the view is built: the drawing code redacts nothing."""
    window = next(f for f in hostile.figures if isinstance(f.spec, Lanes))
    strings = _strings(window)
    assert any("token=[redacted]" in text for _, text in strings)  # the lane's op, its secret masked
    assert not [where for where, text in _strings(hostile.figures) + _strings(hostile.not_drawn)
                for secret in SECRETS.values() if secret in text]
    page = HtmlRenderer().render(hostile)
    assert not [secret for secret in SECRETS.values() if secret in page]


def test_every_string_of_the_fleet_view_is_redacted() -> None:
    """The fleet page's view is typed and redacted in the model, as a Report is: the source URL's password too."""
    view = build_fleet_view(fleet_report(hostile=True))
    strings = _strings(view)
    assert any(XSS_SCRIPT in text for _, text in strings) and any("[redacted]@prometheus" in t for _, t in strings)
    assert not [(where, secret) for where, text in strings for secret in SECRETS.values() if secret in text]


def test_the_fleet_page_shows_what_the_view_says() -> None:
    view = build_fleet_view(fleet_report())
    first = dataclasses.replace(view.rows[0], headline="Headline from the view.", node="node-from-the-view")
    detail = dataclasses.replace(view.details[0], row=first, to_collect=("collect-from-the-view",))
    summary = dataclasses.replace(view.summary, price_note="price-note-from-the-view")
    other: FleetView = dataclasses.replace(view, rows=(first, *view.rows[1:]), details=(detail, *view.details[1:]),
                                           summary=summary, source="source-from-the-view")
    page = HtmlRenderer().render_fleet(other)
    for text in ("Headline from the view.", "node-from-the-view", "collect-from-the-view",
                 "price-note-from-the-view", "source-from-the-view"):
        assert text in page


def test_the_renderers_show_what_the_report_says(hostile: Report) -> None:
    """Changing a view changes the output: the renderers do not derive it again from a diagnosis."""
    report = dataclasses.replace(hostile, headline="Headline from the report.", target="target-from-the-report",
                                 near_tie="Near tie from the report.", to_collect=["collect-from-the-report"])
    buf = io.StringIO()
    TerminalRenderer(file=buf, color=False, width=200).render(report, verbose=True)
    page = HtmlRenderer().render(report)
    for text in ("Headline from the report.", "target-from-the-report", "Near tie from the report.",
                 "collect-from-the-report"):
        assert text in buf.getvalue() and text in page


def test_json_is_the_document_and_only_the_json_reads_it(hostile: Report) -> None:
    assert JsonRenderer().render(hostile) == dumps(hostile.document)
    other = dataclasses.replace(hostile, document=diagnose(case_capture("idle")))
    buf, other_buf = io.StringIO(), io.StringIO()
    TerminalRenderer(file=buf, color=False).render(hostile, verbose=True)
    TerminalRenderer(file=other_buf, color=False).render(other, verbose=True)
    assert buf.getvalue() == other_buf.getvalue()
    assert JsonRenderer().render(other) != JsonRenderer().render(hostile)


def test_a_report_of_a_diagnosis_alone_renders_as_html() -> None:
    """A fleet row's report has no run context: its typed context is empty, not a dict without keys."""
    report = report_from_diagnosis(diagnose(case_capture("vram")))
    page = HtmlRenderer().render(report)
    assert report.headline in page and 'data-verdict="vram"' in page
