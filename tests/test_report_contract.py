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

from diagnoser.evidence_build import build_evidence
from diagnoser.reports.html import HtmlRenderer
from diagnoser.reports.jsonout import JsonRenderer, dumps
from diagnoser.reports.model import Report, build_report, report_from_diagnosis
from diagnoser.reports.terminal import TerminalRenderer
from diagnoser.rules import diagnose
from tests.test_report_cases import SECRETS, XSS_SCRIPT, case_capture, hostile_capture

REPORTS = Path(__file__).resolve().parents[1] / "diagnoser" / "reports"
RENDERERS = ("terminal.py", "html.py")
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


def test_terminal_leaves_redaction_to_the_model() -> None:
    names = {a.name for n in ast.walk(_tree("terminal.py")) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & {"redact", "redact_argv", "redact_obj"}


def _strings(obj: Any, path: str = "report") -> list[tuple[str, str]]:
    """Every string a Report holds for a renderer, with where it sits (the JSON document and figures excepted:
    jsonout redacts the document whole, and the figures are drawn data)."""
    if isinstance(obj, str):
        return [(path, obj)]
    if isinstance(obj, Report):
        return [s for f in dataclasses.fields(obj) if f.name not in ("document", "figures")
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
    ev = build_evidence(capture)
    return build_report(capture, ev, diagnose(capture))


def test_every_string_of_the_report_is_redacted(hostile: Report) -> None:
    strings = _strings(hostile)
    assert any(XSS_SCRIPT in text for _, text in strings)  # the capture's strings are there, markup and all
    leaks = [(where, secret) for where, text in strings for secret in SECRETS.values() if secret in text]
    assert not leaks


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
