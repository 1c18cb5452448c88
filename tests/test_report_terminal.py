"""The terminal summary: at most 80 columns, plain text (no control codes) when not a terminal, styled when asked,
markup in untrusted strings shown literally, secrets redacted."""

from __future__ import annotations

import io
import re

import pytest

from diagnoser.reports.model import report_from_diagnosis
from diagnoser.reports.terminal import TerminalRenderer
from diagnoser.rules import diagnose
from tests.test_report_cases import LIMITERS, SECRETS, case_diagnosis, hostile_capture

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def render(d: object, **kwargs: object) -> str:
    buf = io.StringIO()
    verbose = bool(kwargs.pop("verbose", False))
    TerminalRenderer(file=buf, **kwargs).render(report_from_diagnosis(d), verbose=verbose)  # type: ignore[arg-type]
    return buf.getvalue()


@pytest.mark.parametrize("limiter", LIMITERS)
def test_plain_summary_fits_80_columns(limiter: str) -> None:
    _, d = case_diagnosis(limiter)
    out = render(d)  # a StringIO is not a terminal: plain text
    assert "\x1b" not in out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert all(line == line.rstrip() for line in lines)
    label = d.limiter.label if d.limiter else "inconclusive"
    assert lines[0].startswith(f"VERDICT {label.upper()}")
    assert f"confidence {d.confidence_label} ({d.confidence:.2f})" in lines[0]
    words = " ".join(out.split())  # titles may wrap at 80 columns
    for fix in d.fixes[:3]:
        assert fix.title in words
    for f in d.findings:
        assert f.code in out
    if d.to_collect:
        assert "collect" in out


def test_reading_order() -> None:
    _, d = case_diagnosis("batching")
    out = render(d)
    positions = [out.index(s) for s in ("VERDICT", "Top fixes", "Evidence", "Not available")]
    assert positions == sorted(positions)


def test_citations_show_threshold_and_source() -> None:
    _, d = case_diagnosis("memory_bandwidth")
    out = render(d)
    assert re.search(r"- gpu\.dram_active mean = 7\d % \(>= 60 %\) \[gpm\]", out)


def test_colour_when_asked_and_narrow_terminals() -> None:
    _, d = case_diagnosis("vram")
    styled = render(d, color=True)
    assert ANSI.search(styled)
    assert max(len(ANSI.sub("", line)) for line in styled.splitlines()) <= 80
    narrow = render(d, width=60)
    assert max(len(line) for line in narrow.splitlines()) <= 60


def test_verbose_shows_every_fix_and_skipped_rules() -> None:
    _, d = case_diagnosis("host_launch")
    short, full = render(d), render(d, verbose=True)
    assert len(d.fixes) > 3
    assert d.fixes[-1].title not in short and "more with --verbose" in short
    assert all(f.title in full for f in d.fixes) and "basis:" in full
    assert "Rules skipped for lack of signals" in full and d.skipped[0].code in full


def test_untrusted_markup_is_literal_and_secrets_redacted() -> None:
    capture = hostile_capture()
    capture.target = f"pid 1 [bold red]boom[/] [link=https://evil]x[/link] --api-key {SECRETS['sk']}"
    d = diagnose(capture)
    for color in (False, True):
        out = ANSI.sub("", render(d, color=color))
        assert "[bold red]boom[/]" in out and "[link=https://evil]x[/link]" in out
        assert "\x1b]8;" not in render(d, color=color)  # no hyperlink escape was produced
        for secret in SECRETS.values():
            assert secret not in out
        assert "--api-key [redacted]" in out
